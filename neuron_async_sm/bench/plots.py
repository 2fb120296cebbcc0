"""PNG plots of a benchmark report (matplotlib, a dev extra: imported only when plotting)."""

from __future__ import annotations

from pathlib import Path

from neuron_async_sm.bench.sweep import ideal_speedup


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plots needs matplotlib (pip install -e '.[dev]')") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict, directory: str | Path) -> list[Path]:
    """One PNG per section present in `report` (sweep, host_cost_batch, host_cost_waiting, vs_transformers)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []
    for key, draw, name in (
        ("sweep", _sweep, "bench_speedup_vs_dc.png"),
        ("host_cost_batch", _host_batch, "bench_host_cost_batch.png"),
        ("host_cost_waiting", _host_waiting, "bench_host_cost_waiting.png"),
        ("vs_transformers", _peer, "bench_vs_transformers.png"),
    ):
        if key in report:
            fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
            draw(ax, report[key])
            fig.tight_layout()
            fig.savefig(out / name, bbox_inches="tight")  # keeps a legend placed below the axes
            plt.close(fig)
            written.append(out / name)
    return written


def _sweep(ax, sweep: dict) -> None:
    points = sorted(sweep["points"], key=lambda p: p["D_over_C"])
    ratios = [p["D_over_C"] for p in points]
    lo, hi = min(ratios + [0.25]) * 0.8, max(ratios + [4.0]) * 1.25
    grid = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    ideal = [ideal_speedup(r) for r in grid]
    ax.plot(grid, ideal, color="black", label="ideal (C + D) / max(C, D)")
    ax.fill_between(grid, [0.9 * y for y in ideal], ideal, color="0.85", label="within 10% of ideal")
    ax.plot(ratios, [p["speedup"] for p in points], "-", color="tab:blue", alpha=0.5)
    for kind, marker, label in (
        ("device hold", "o", "measured, D held (--device-time-ms)"),
        ("host spin", "s", "measured, C raised (extra host work)"),
        ("real compute", "*", "measured, real compute (no hold, no extra)"),
    ):
        mine = [p for p in points if p.get("kind", "device hold") == kind]
        if mine:
            ax.plot(
                [p["D_over_C"] for p in mine],
                [p["speedup"] for p in mine],
                marker,
                color="tab:blue",
                markersize=11 if marker == "*" else 6,
                linestyle="none",
                label=label,
            )
    ax.plot(
        ratios,
        [p["ideal_speedup"] for p in points],
        "x",
        color="black",
        label="ideal from the sync run's per-step C and D",
    )
    if all("ideal_speedup_with_transport" in p for p in points):
        ax.plot(
            ratios,
            [p["ideal_speedup_with_transport"] for p in points],
            "^",
            color="tab:red",
            fillstyle="none",
            label="bound with the transport O as host time: (C + O + D) / max(C + O, D)",
        )
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks([0.25, 0.5, 1, 2, 4])
    ax.set_xticklabels(["0.25", "0.5", "1", "2", "4"])
    ax.set_xlabel("D / C (device time / host time per step, measured)")
    ax.set_ylabel("speedup of async over sync")
    ax.set_title(f"Async speedup vs D/C ({sweep['model'].split(' ')[0]}, batch {sweep['batch']})")
    ax.set_ylim(0.8, max([2.1] + [p["speedup"] + 0.1 for p in points]))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7)  # below: the data fill the axes


def _host_batch(ax, data: dict) -> None:
    rows = data["rows"]
    batches = [r["batch"] for r in rows]
    fits = data.get("linear_fit", {})
    for mode, color in (("sync", "tab:orange"), ("async", "tab:blue")):
        ax.plot(batches, [r[f"{mode}_host_us"] for r in rows], "o", color=color, label=f"C per step, {mode}")
        if mode in fits:  # linear axes: a straight line is linear growth
            a, b = fits[mode]["intercept_us"], fits[mode]["slope_us_per_request"]
            ax.plot(
                [0, max(batches)],
                [a, a + b * max(batches)],
                "--",
                color=color,
                alpha=0.7,
                label=f"fit {a:.0f} µs + {b:.1f} µs x batch",
            )
    ax.set_xticks(batches[2:] if len(batches) > 4 else batches)
    ax.set_xlim(left=0)
    _host_axes(ax, "running requests (decode batch)", "Host cost per step vs batch size")


def _host_waiting(ax, data: dict) -> None:
    rows = data["rows"]
    waiting = [max(r["waiting"], 1) for r in rows]
    for mode, color in (("sync", "tab:orange"), ("async", "tab:blue")):
        ax.plot(waiting, [r[f"{mode}_host_us"] for r in rows], "o-", color=color, label=f"C per step, {mode}")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(waiting)
    ax.set_xticklabels([str(r["waiting"]) for r in rows])
    _host_axes(ax, f"waiting requests ({data['running']} running)", "Host cost per step vs waiting requests")


def _host_axes(ax, xlabel: str, title: str) -> None:
    """What both host-cost plots share: the y axis from zero, labels, grid, legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("host time per step (µs, median)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _peer(ax, data: dict) -> None:
    rows = data["rows"]
    x = range(len(rows))
    series = [("ours_tokens_per_s", "neuron_async_sm (async; device owns 1 core)")]
    series += [
        (f"transformers_{n}t_tokens_per_s", f"transformers generate(), {n} thread(s)")
        for n in data["transformers_threads"]
    ]
    width = 0.8 / len(series)
    for j, (key, label) in enumerate(series):
        offset = (j - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in x], [r[key] for r in rows], width, label=label)
    for i, r in enumerate(rows):
        top = max(r[key] for key, _ in series)
        ax.annotate(f"{r['ratio']:.2f}x", (i, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([str(r["batch"]) for r in rows])
    ax.set_xlabel("batch (prompts decoded together); label: ours / best transformers")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"tokens/s vs transformers (greedy, {data['new_tokens']} new tokens)")
    ax.legend(fontsize=8)


SERVE_PLOT = "bench_serve.png"


def write_serve_plot(report: dict, directory: str | Path) -> Path:
    """TTFT and TPOT (p50 solid, p99 dashed) against the request rate, one line per mode: bench_serve.png."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    labels = report["config"]["request_rates"]
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.2), dpi=110)
    colors = {"sync": "tab:orange", "async": "tab:blue"}
    for ax, metric, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        for mode, rows in report["results"].items():
            by_label = {r["rate_label"]: r for r in rows}
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [by_label[x][f"{metric}_ms_{q}"] for x in labels]
                ax.plot(
                    range(len(labels)),
                    ys,
                    style,
                    color=colors.get(mode, "tab:green"),
                    label=f"{mode} {q}",
                    fillstyle="full" if q == "p50" else "none",
                )
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (requests/s, Poisson; inf: all at once)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")  # queueing at the highest rates dwarfs the light-load TTFT
    axes[0].yaxis.set_major_formatter(ScalarFormatter())  # 20, not 2 x 10^1
    axes[0].yaxis.set_minor_formatter(NullFormatter())
    c = report["config"]
    fig.suptitle(
        f"bench serve: {c['model']}, {c['num_prompts']} prompts x {c['input_len']} -> {c['output_len']} "
        f"tokens, medians of {c['repetitions']} alternating runs",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / SERVE_PLOT
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
