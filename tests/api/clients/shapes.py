"""The pydantic shapes the client tests ask for, shared by the in-process tests and the scripts run
in the clients' venvs (pydantic only). Strings are bounded: a random model's string would
otherwise run to max_tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

ASK = "What is the weather in Paris?"


class Forecast(BaseModel):
    """A forecast for one city."""

    city: str = Field(max_length=10)
    celsius: int = Field(ge=-40, le=50)
    sky: Literal["sunny", "cloudy", "rain"]


class WeatherArgs(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=14)


def get_weather(city: str, days: int) -> str:
    """The weather in a city for some days."""
    return f"sunny in {city} for {days} days"
