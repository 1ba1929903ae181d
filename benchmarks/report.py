"""The `shapes` report: a table on stdout and a PNG (decode tok/s, acceptance length, per-depth acceptance and
verify / draft ms per shape, cold start; needs matplotlib). --from-result re-renders a saved report."""
from __future__ import annotations

import statistics
from pathlib import Path

from .shapes import GOALS


def _host(res: dict) -> dict:
    """The host record (results before the harness called it "machine")."""
    return res.get("host") or res.get("machine") or {}


def _threads(res: dict) -> str:
    n = _host(res).get("threads") or 1
    return f"{n} CPU thread{'s' if n > 1 else ''}"


def _n(x: float | None) -> str:
    """A rate or ratio with enough digits to be read whatever its size."""
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _goal(value: float, key: str) -> str:
    g = GOALS[key]
    return f"goal >= {g}x: {'met' if value >= g else 'NOT met'}"


def render_table(res: dict) -> str:
    lines = []
    s = res["summary"]
    b, pr = res["bundle"], res["prompts"]
    decode = res.get("decode") or []
    if decode:
        w = max(5, *(len(e["name"]) for e in decode))
        lines.append(f"decode, greedy, {_threads(res)}, {pr['count']} prompts, max_tokens {pr['max_tokens']} "
                     f"({b['backend']}, {b['dtype']}); tok/s = decode tokens/s, TPOT median over prompts; ms per "
                     "verify pass / draft graphs per round / plain decode pass")
        lines.append(f"{'shape':<{w}} {'spec tok/s':>10} {'plain tok/s':>11} {'speedup':>7} {'TPOT ms':>8} "
                     f"{'TTFT ms':>8} {'accept len':>10} {'nodes':>5} {'verify ms':>9} {'draft ms':>8} "
                     f"{'plain ms':>8} {'spec==plain':>11}  per-depth acceptance")
        for e in decode:
            a, r = e["acceptance"], e.get("round_ms", {})
            ms = lambda x: f"{x:.1f}" if x is not None else "-"  # noqa: E731
            lines.append(f"{e['name']:<{w}} {_n(e['spec']['decode_tok_s']):>10} {_n(e['plain']['decode_tok_s']):>11} "
                         f"{e['speedup_decode']:>6.2f}x {e['spec']['tpot_ms_median']:>8.2f} "
                         f"{e['spec']['ttft_ms_median']:>8.1f} {a['mean_acceptance_length']:>10.2f} "
                         f"{e['nodes_per_verify']:>5} {ms(r.get('verify_ms')):>9} {ms(r.get('draft_ms_per_round')):>8} "
                         f"{ms(r.get('plain_decode_ms')):>8} {e['spec_equals_plain']:>11}  "
                         + ", ".join(f"{x:.3f}" for x in a["per_position_acceptance_rate"]))
        for e in decode:
            lines.append(f"  {e['name']}: {e['shape']['describe']}" + "".join(
                f"; {name} {g['mean_ms']:.1f} ms x {g['calls']}" for name, g in e.get("graphs", {}).items()
                if "prefill" not in name))
    for t in res.get("transformers", {}).values():
        lines.append(f"transformers eager {t['dtype']:<9}: {_n(t['decode_tok_s'])} tok/s decode, TPOT "
                     f"{t['tpot_ms_median']:.2f} ms, TTFT {t['ttft_ms_median']:.1f} ms"
                     + (f", same tokens as the runtime: {t['same_as_runtime']}" if "same_as_runtime" in t else ""))
    lines.append("")
    if "spec_vs_plain" in s:
        lines.append(f"best shape {s['best_shape']} ({s['best_shape_describe']}): speculation vs none "
                     f"{s['spec_vs_plain']:.2f}x ({_n(s['spec_decode_tok_s'])} vs {_n(s['plain_decode_tok_s'])} tok/s, "
                     f"acceptance length {s['best_acceptance_length']:.2f}; {_goal(s['spec_vs_plain'], 'spec_vs_plain')})")
    if "best_vs_chain_k3" in s:
        lines.append(f"best shape vs chain K 3: {s['best_vs_chain_k3']:.3f}x ({_n(s['spec_decode_tok_s'])} vs "
                     f"{_n(s['chain_k3_decode_tok_s'])} tok/s)")
    fastest = s.get("transformers_fastest_dtype")
    for key, label in (("runtime_vs_transformers", f"runtime (best shape) vs transformers eager {fastest} (the faster)"),
                       ("runtime_vs_transformers_same_dtype", f"runtime (best shape) vs transformers eager {b['dtype']}")):
        if s.get(key) is not None and not (key.endswith("same_dtype") and fastest == b["dtype"]):
            lines.append(f"{label}: {_n(s[key])}x ({_goal(s[key], 'runtime_vs_transformers')})")
    c = res.get("cold_start", {})
    if "prebuilt" in c:
        lines.append(f"cold start, {c.get('shape')} bundle (fresh process, prebuilt bundle -> first token): median "
                     f"{c['prebuilt']['median_s']:.2f}s of {c['prebuilt']['runs_s']}")
    if "compile_then_load" in c:
        ctl = c["compile_then_load"]
        lines.append(f"compile (empty cache) -> load -> first token, fresh process, {ctl.get('shape')} bundle: "
                     f"{ctl['median_s']:.1f}s" + (f" (reused from {ctl['reused_from']})" if "reused_from" in ctl else ""))
    if "cold_start_vs_compile" in s:
        lines.append(f"cold start vs compile-then-load: {s['cold_start_vs_compile']:.1f}x "
                     f"({_goal(s['cold_start_vs_compile'], 'cold_start_vs_compile')})")
    for note in res.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _mark(value: float, key: str) -> str:
    return f"(goal ≥{GOALS[key]:g}x {'✓' if value >= GOALS[key] else '✗'})"


def plot(res: dict, path: Path) -> None:
    """Decode tok/s, acceptance length, per-depth acceptance and the cost of a round per shape (+ cold start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    d = res["decode"]
    names = [e["name"] for e in d]
    x = list(range(len(d)))
    colors = [plt.get_cmap("tab10")(i % 10) for i in x]
    ticks = [f"{e['name']}\n{e['nodes_per_verify']} nodes/verify" for e in d]
    s = res["summary"]
    has_cold = "prebuilt" in res.get("cold_start", {})
    fig = plt.figure(figsize=(18, 11.5))
    grid = fig.add_gridspec(2, 3, width_ratios=[1.2, 1, 0.9])
    plain_c, hf_c = "#b0b0b0", "#d9822b"

    # 1. decode tok/s per shape
    ax = fig.add_subplot(grid[0, :2])
    w = 0.38
    spec = [e["spec"]["decode_tok_s"] for e in d]
    plain = [e["plain"]["decode_tok_s"] for e in d]
    ax.bar([i - w / 2 for i in x], spec, w, color=colors, label="eagle3 runtime, speculative (bar colour: shape)")
    ax.bar([i + w / 2 for i in x], plain, w, color=plain_c, label="same bundle, no speculation")
    top = max(spec + plain + [t["decode_tok_s"] for t in res.get("transformers", {}).values()])
    for i, e in enumerate(d):
        ax.text(i - w / 2, spec[i], _n(spec[i]), ha="center", va="bottom", fontsize=8.5)
        ax.text(i + w / 2, plain[i], _n(plain[i]), ha="center", va="bottom", fontsize=8, color="#555")
        ax.text(i, max(spec[i], plain[i]) + 0.06 * top, f"{_n(e['speedup_decode'])}x", ha="center",
                va="bottom", fontsize=10, fontweight="bold" if e["name"] == s["best_shape"] else "normal")
    for j, t in enumerate(res.get("transformers", {}).values()):
        ax.axhline(t["decode_tok_s"], color=hf_c, ls=["--", ":"][j % 2], lw=1.6,
                   label=f"transformers eager generate(), {t['dtype']}: {_n(t['decode_tok_s'])} tok/s")
    ax.set_xticks(x, ticks, fontsize=9)
    ax.set_ylabel(f"decode tokens/s ({_threads(res)}, greedy)")
    ttl = (f"Decode speed — best {s['best_shape']} ({s['best_shape_describe']}): {s['spec_vs_plain']:.2f}x over no "
           f"speculation {_mark(s['spec_vs_plain'], 'spec_vs_plain')}")
    extra = []
    if "best_vs_chain_k3" in s:
        extra.append(f"{s['best_vs_chain_k3']:.2f}x chain K 3")
    if s.get("runtime_vs_transformers"):
        extra.append(f"{_n(s['runtime_vs_transformers'])}x the faster transformers eager "
                     f"{_mark(s['runtime_vs_transformers'], 'runtime_vs_transformers')}")
    ax.set_title(ttl + ("\n" + ", ".join(extra) if extra else ""), fontsize=10.5)
    ax.set_ylim(0, top * 1.18)
    ax.legend(loc="upper right", fontsize=8.5, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)

    # 2. acceptance length per shape
    ax = fig.add_subplot(grid[0, 2])
    lens = [e["acceptance"]["mean_acceptance_length"] for e in d]
    ax.bar(x, lens, color=colors, width=0.6)
    for i, v in enumerate(lens):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    ax.axhline(1, color="#555", lw=0.8)
    ax.set_xticks(x, names, fontsize=8.5, rotation=20)
    ax.set_ylim(0, max(lens + [1]) * 1.15)
    ax.set_ylabel("tokens per verify pass")
    ax.set_title("Mean acceptance length\n(accepted drafts + the bonus token, per round)", fontsize=10.5)
    ax.grid(axis="y", alpha=0.3)

    # 3. per-depth acceptance
    ax = fig.add_subplot(grid[1, 0])
    for i, e in enumerate(d):
        rates = e["acceptance"]["per_position_acceptance_rate"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=colors[i],
                label=f"{e['name']}: {e['acceptance']['mean_acceptance_length']:.2f}")
    dmax = max(len(e["acceptance"]["per_position_acceptance_rate"]) for e in d)
    ax.set_xticks(range(1, dmax + 1))
    ax.set_xlim(0.7, dmax + 0.3)
    ax.set_ylim(0, 1)
    ax.set_xlabel("depth")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("Acceptance per depth\n(fraction of rounds that accepted a path at least this deep)", fontsize=10.5)
    ax.legend(fontsize=8.5, title="shape: acceptance length", title_fontsize=8.5)
    ax.grid(alpha=0.3)

    # 4. the cost of one round per shape
    ax = fig.add_subplot(grid[1, 1] if has_cold else grid[1, 1:])
    verify = [e.get("round_ms", {}).get("verify_ms") or 0 for e in d]
    draft = [e.get("round_ms", {}).get("draft_ms_per_round") or 0 for e in d]
    ax.bar(x, verify, 0.6, color=colors, label="target_verify (one pass)")
    ax.bar(x, draft, 0.6, bottom=verify, color=colors, alpha=0.45, hatch="//", label="draft graphs per round")
    for i in x:
        ax.text(i, verify[i] + draft[i], f"{verify[i]:.1f} + {draft[i]:.1f}", ha="center", va="bottom", fontsize=8.5)
    plain_ms = [e["round_ms"]["plain_decode_ms"] for e in d if e.get("round_ms", {}).get("plain_decode_ms")]
    if plain_ms:
        ax.axhline(statistics.median(plain_ms), color="#555", ls="--", lw=1.2,
                   label=f"one plain decode pass: {statistics.median(plain_ms):.1f} ms")
    ax.set_xticks(x, names, fontsize=8.5, rotation=20)
    ax.set_ylim(0, max([a + b for a, b in zip(verify, draft)] + plain_ms + [1]) * 1.4)
    ax.set_ylabel("ms per speculative round (mean)")
    ax.set_title("Cost of a round: verify ms + draft ms", fontsize=10.5)
    ax.legend(fontsize=8.5, loc="upper left")
    ax.grid(axis="y", alpha=0.3)

    # 5. cold start
    if has_cold:
        ax = fig.add_subplot(grid[1, 2])
        c = res["cold_start"]
        labels, vals, cols = ["prebuilt bundle\n→ first token"], [c["prebuilt"]["median_s"]], ["#2a7ab0"]
        if "compile_then_load" in c:
            labels.append("compile (empty cache)\n→ load → first token")
            vals.append(c["compile_then_load"]["median_s"])
            cols.append(hf_c)
        ax.bar(labels, vals, color=cols, width=0.6)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}s" if v >= 10 else f"{v:.2f}s", ha="center", va="bottom", fontsize=10)
        ax.set_yscale("log")
        ax.set_ylim(min(vals) / 2, max(vals) * 3)
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}s"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel("seconds, fresh process (log scale)")
        ttl = f"Cold start, {c.get('shape')} bundle"
        if "compile_then_load" in c:
            ttl += (f":\nprebuilt {s['cold_start_vs_compile']:.0f}x faster "
                    f"{_mark(s['cold_start_vs_compile'], 'cold_start_vs_compile')}")
        ax.set_title(ttl, fontsize=10.5)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.tick_params(axis="x", labelsize=9)

    b = res["bundle"]
    fig.suptitle(f"EAGLE3 speculation shapes on {b['name']} — {b['backend']} backend, {b['dtype']}, "
                 f"{res['prompts']['count']} chat prompts × ≤{res['prompts']['max_tokens']} tokens, {_threads(res)} — "
                 f"{_host(res).get('cpu', '?')}", fontsize=11)
    notes = res.get("notes", [])
    if notes:
        fig.text(0.01, 0.005, "\n".join(f"Note: {n}" for n in notes), fontsize=8.5, va="bottom", ha="left",
                 wrap=True, color="#8a1c1c")
    fig.tight_layout(rect=(0, 0.025 * (1 + sum(len(n) // 200 for n in notes)) * bool(notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
