"""Batch jobs: the runner and its callbacks (the API's façade onto them)."""

from services.batch.jobs import BatchConfig
from services.batch.webhooks import CallbackPolicy, CallbackUnreachable, WebhookClient

__all__ = ["BatchConfig", "CallbackPolicy", "CallbackUnreachable", "WebhookClient"]
