"""peers.py's report: the table of medians and paired galley / peer ratios (the peer: vLLM-CPU or
llama.cpp, whichever ran), the agreement of galley's completions with each peer's, TTFT by turn,
and the chart."""

from __future__ import annotations

import statistics
from pathlib import Path

from client import common_prefix_len, log
from peers_measure import Run, Workload
from servers import GALLEY

METRICS = (  # key, column title, format; lower is better for all but tok/s and hits; hit rate last
    ("tok_s", "tok/s", ".1f"),
    ("ttft_mean_s", "TTFT mean s", ".2f"),
    ("ttft_p50_s", "TTFT p50 s", ".2f"),
    ("ttft_p99_s", "TTFT p99 s", ".2f"),
    ("itl_p50_ms", "ITL p50 ms", ".0f"),
    ("itl_p99_ms", "ITL p99 ms", ".0f"),
    ("prefix_hit_rate", "prefix hits", ".0%"),
)


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def median_of(runs: list[Run], key: str) -> float | None:
    values = [v for r in runs if (v := r.metrics().get(key)) is not None]
    return statistics.median(values) if values else None


def peers_of(names: list[str]) -> list[str]:
    """The systems galley is compared with: all others, if galley ran."""
    return [n for n in names if n != GALLEY] if GALLEY in names else []


def paired_ratios(runs: list[Run], workload: str, key: str, peer: str) -> list[float]:
    """galley / peer of each repetition's pair of runs (minutes apart at most)."""
    by_rep: dict[int, dict[str, float | None]] = {}
    for r in runs:
        if r.workload == workload:
            by_rep.setdefault(r.repetition, {})[r.system] = r.metrics().get(key)
    return [p[GALLEY] / p[peer] for p in by_rep.values() if p.get(GALLEY) is not None and p.get(peer)]


def fmt_ratio(ratios: list[float]) -> str:
    if not ratios:
        return "n/a"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}{spread}"


def agreement(runs: list[Run], workload: str, peer: str) -> tuple[int, int, float]:
    """Completions identical in galley and `peer` (ids, or text with a real tokenizer), completions
    compared, mean common prefix."""
    pairs: dict[int, dict[str, Run]] = {}
    for r in runs:
        if r.workload == workload and not r.error:
            pairs.setdefault(r.repetition, {})[r.system] = r
    compared = [
        (a, b)
        for p in pairs.values()
        if GALLEY in p and peer in p
        for a, b in zip(p[GALLEY].outputs, p[peer].outputs, strict=True)
    ]
    same = sum(a == b for a, b in compared)
    prefix = statistics.fmean(common_prefix_len(a, b) for a, b in compared) if compared else 0.0
    return same, len(compared), prefix


def render_table(runs: list[Run], workloads: list[Workload], names: list[str]) -> str:
    head = ["workload", "system", *(title for _, title, _ in METRICS), "others (cores)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        for name in names:
            mine = [r for r in runs if r.workload == w.name and r.system == name]
            cells = [fmt(median_of(mine, key), spec) for key, _, spec in METRICS]
            others = statistics.median([r.cores["others"] for r in mine]) if mine else None
            lines.append(f"| {w.name} | {name} | " + " | ".join(cells) + f" | {fmt(others, '.2f')} |")
        for peer in peers_of(names):
            cells = [fmt_ratio(paired_ratios(runs, w.name, key, peer)) for key, _, _ in METRICS[:-1]]  # not hit rates
            lines.append(f"| {w.name} | galley / {peer} | " + " | ".join(cells) + " | | |")
    return "\n".join(lines)


def render_turns(runs: list[Run], w: Workload, names: list[str]) -> str:
    keys = [f"ttft_turn{t + 1}_s" for t in range(w.num_turns)]
    lines = [
        f"| {w.name}: TTFT mean by turn, s | " + " | ".join(f"turn {t + 1}" for t in range(w.num_turns)) + " |",
        "|" + "---|" * (w.num_turns + 1),
    ]
    for name in names:
        mine = [r for r in runs if r.workload == w.name and r.system == name]
        lines.append(f"| {name} | " + " | ".join(fmt(median_of(mine, k), ".2f") for k in keys) + " |")
    for peer in peers_of(names):
        ratios = (fmt_ratio(paired_ratios(runs, w.name, k, peer)) for k in keys)
        lines.append(f"| galley / {peer} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def render(runs: list[Run], workloads: list[Workload], names: list[str], header: list[str]) -> str:
    parts = [*header, "", render_table(runs, workloads, names)]
    parts += ["", *(f"- {w.name}: {w.describe()}" for w in workloads)]
    peers = peers_of(names)
    unit = "characters" if any(isinstance(o, str) for r in runs for o in r.outputs) else "tokens"
    for peer in peers:
        parts.append("")
        within = "both" if len(peers) == 1 else f"galley and {peer}"
        for w in workloads:
            same, total, prefix = agreement(runs, w.name, peer)
            parts.append(
                f"- {w.name}: {same}/{total} completions identical in {within}, mean common prefix {prefix:.1f} {unit}"
            )
    for w in workloads:
        if w.num_turns > 1 and w.carry_history:
            parts += ["", render_turns(runs, w, names)]
    return "\n".join(parts)


def draw_chart(path: Path, runs: list[Run], workloads: list[Workload], names: list[str], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no chart: matplotlib is not installed (`pip install matplotlib`, a bench-only dependency)")
        return
    panels = [
        ("tok_s", "output tok/s (higher is better)"),
        ("ttft_mean_s", "TTFT mean, s"),
        ("itl_p50_ms", "ITL p50, ms"),
    ]
    multi_turn = [w for w in workloads if w.carry_history and w.num_turns > 1][:1]
    fig, axes = plt.subplots(1, len(panels) + len(multi_turn), figsize=(4 * (len(panels) + len(multi_turn)), 3.6))
    width = 0.8 / len(names)

    def bars(ax, groups: list[str], keys_runs: list[tuple[str, list[Run]]], name: str, i: int) -> None:
        values = [[v for r in rs if r.system == name and (v := r.metrics().get(k)) is not None] for k, rs in keys_runs]
        mid = [statistics.median(v) if v else 0 for v in values]
        err = [
            [m - min(v, default=m) for m, v in zip(mid, values)],
            [max(v, default=m) - m for m, v in zip(mid, values)],
        ]
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(groups))]
        ax.bar(xs, mid, width, yerr=err, capsize=3, label=name, color=("tab:blue", "tab:orange", "tab:green")[i])
        ax.set_xticks(range(len(groups)), groups)

    for ax, (key, label) in zip(axes, panels):
        for i, name in enumerate(names):
            bars(
                ax,
                [w.name for w in workloads],
                [(key, [r for r in runs if r.workload == w.name]) for w in workloads],
                name,
                i,
            )
        ax.set_title(label, fontsize=10)
    for ax, w in zip(axes[len(panels) :], multi_turn):
        mine = [r for r in runs if r.workload == w.name]
        for i, name in enumerate(names):
            bars(
                ax,
                [f"turn {t + 1}" for t in range(w.num_turns)],
                [(f"ttft_turn{t + 1}_s", mine) for t in range(w.num_turns)],
                name,
                i,
            )
        ax.set_title(f"{w.name}: TTFT mean by turn, s", fontsize=10)
    axes[0].legend(fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    log(f"chart written to {path}")
