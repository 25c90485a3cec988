"""A PNG of a run's curves: the reward (and any other *reward metric) and the engine/trainer
logprob gap, per step. Drawn on matplotlib's Agg canvas, without pyplot: no display, and no
backend switched for the rest of the process."""

from __future__ import annotations


def write_plot(history: list[dict[str, float]], path: str, title: str) -> bool:
    """Writes the PNG to path; False (and nothing written) when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    steps = [h["step"] for h in history]
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    rewards, gaps = fig.subplots(1, 2)
    for key in sorted(k for k in history[0] if k.endswith("reward")):
        rewards.plot(steps, [h[key] for h in history], marker=".", label=key)
    rewards.set(xlabel="step", ylabel="mean reward", title="reward")
    rewards.legend()
    gap = [h["logprob_gap"] for h in history]
    gaps.plot(steps, gap, marker=".", color="tab:red")
    # Float32 gaps sit near 1e-7 and bf16 ones near 1e-3: only a log axis shows both moving.
    if all(g > 0 for g in gap):
        gaps.set_yscale("log")
    gaps.set(xlabel="step", ylabel="mean |engine - trainer| logprob", title="logprob gap")
    for axes in (rewards, gaps):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True
