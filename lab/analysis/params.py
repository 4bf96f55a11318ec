"""blocklab params: where the weights sit, by component, with the formula beside each count.

    blocklab params                         # GPT-2 small
    blocklab params --config llama3.1-8b    # gated feed-forward, grouped-query attention, untied head
    blocklab params --model builtin         # any model blocklab loads
    blocklab params --all                   # the feed-forward's share of a block across designs

Counts come from the design's formulas; for a model blocklab can build, the "counted" column sums the
parameters of the instantiated modules (on the meta device: no memory), so formula and model agree or
the table shows where they do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab import flags
from lab.analysis import common
from lab.analysis.designs import DESIGNS, Design
from lab.model import GPT


def counted(model: GPT) -> dict[str, int]:
    """Parameters of the instantiated modules, under the component names of ``Design``'s counts."""
    n = common.weights
    block = model.blocks[0]
    return {
        "attention": n(block.attn),
        "feed-forward": n(block.mlp),
        "norms": n(block.ln_1, block.ln_2, block.ln_1_out, block.ln_2_out),
        "block": n(block),
        "blocks": n(model.blocks),
        "token table": model.wte.weight.numel(),
        "position table": model.wpe.weight.numel(),
        "final norm": n(model.ln_f),
        "output head": 0,  # unembed() multiplies by wte.weight: no parameter of its own
        "total": common.total_weights(model),
    }


def _key(component: str) -> str:
    """The ``counted`` key a Design component name corresponds to."""
    for key in ("attention", "feed-forward", "position table", "token table", "final norm", "output head"):
        if component.startswith(key):
            return key
    if component.endswith("blocks"):
        return "blocks"
    return "norms" if "Norm" in component else component


def describe(design: Design, model: GPT | None = None) -> dict:
    """The report of one design; ``model`` (when given) supplies the counted column."""
    seen = counted(model) if model is not None else {}
    block_params = design.value(design.block())
    total = design.total_params()

    def rows(counts, whole):
        return [
            {
                "component": c.component,
                "formula": c.formula,
                "params": c.params,
                "counted": seen.get(_key(c.component)),
                "share": c.params / whole,
            }
            for c in counts
        ]

    ff = design.value(design.feed_forward())
    return {
        "design": design.name,
        "source": design.source,
        "shape": {
            "d": design.d_model,
            "L": design.n_layer,
            "n_head": design.n_head,
            "n_kv_head": design.n_kv_head,
            "d_ff": design.d_ff,
            "V": design.vocab_size,
            "T": design.context,
        },
        "block": rows(design.block_counts(), block_params),
        "model": rows(design.model_counts(), total),
        "total": total,
        "total_counted": seen.get("total"),
        "non_embedding": total - design.embedding_params(),
        "token_table_share": design.vocab_size * design.d_model / total,
        "feed_forward_share_of_block": ff / block_params,
        "attention_share_of_block": design.value(design.attention()) / block_params,
        "tied_head": design.tied_head,
    }


def render(report: dict) -> str:
    s = report["shape"]
    head = (
        f"params: {report['design']}  d={s['d']} L={s['L']} heads={s['n_head']} (kv {s['n_kv_head']}) "
        f"d_ff={s['d_ff']} V={s['V']} T={s['T']}"
    )
    columns = ["component", "formula", "params", "counted", "share"]

    def lines(rows):
        return [
            [r["component"], r["formula"], r["params"], r["counted"], f"{100 * r['share']:.2f}%"]
            for r in rows
        ]

    model_rows = lines(report["model"]) + [["total", "", report["total"], report["total_counted"], "100%"]]
    return "\n".join(
        [
            head,
            f"source: {report['source']}" if report["source"] else "",
            "",
            "per block (share of the block):",
            common.table(columns, lines(report["block"])),
            "",
            "model (share of all parameters):",
            common.table(columns, model_rows),
            "",
            f"token table: {100 * report['token_table_share']:.1f}% of all parameters; "
            "output head "
            + ("tied to the token table" if report["tied_head"] else "untied (its own V x d matrix)"),
            f"non-embedding parameters (all but the token and position tables): {report['non_embedding']:,}",
            f"feed-forward: {100 * report['feed_forward_share_of_block']:.1f}% of a block, "
            f"attention: {100 * report['attention_share_of_block']:.1f}%",
        ]
    )


def compare(designs: list[Design]) -> tuple[list[dict], str]:
    rows = [describe(d) for d in designs]
    columns = ["design", "L", "d", "heads (kv)", "d_ff", "params", "non-embedding", "ff/block", "attn/block",
               "token table", "head"]  # fmt: skip
    lines = [
        [
            r["design"],
            r["shape"]["L"],
            r["shape"]["d"],
            f"{r['shape']['n_head']} ({r['shape']['n_kv_head']})",
            r["shape"]["d_ff"],
            r["total"],
            r["non_embedding"],
            f"{100 * r['feed_forward_share_of_block']:.1f}%",
            f"{100 * r['attention_share_of_block']:.1f}%",
            f"{100 * r['token_table_share']:.1f}%",
            "tied" if r["tied_head"] else "untied",
        ]  # fmt: skip
        for r in rows
    ]
    return rows, common.table(columns, lines)


@dataclass
class ParamsOptions:
    """What to count."""

    all: bool = False
    """Compare every preset design in one table."""


def parser() -> flags.Parser:
    p = common.parser("params", "Parameters by component, with the formula beside each count.")
    common.add_design_args(p)
    p.add_options(ParamsOptions)
    common.add_output_args(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])

    if args.all:
        rows, text = compare(list(DESIGNS.values()))
        common.emit(args, {"designs": rows}, text)
        return 0
    design, model = common.design_from_args(args)
    report = describe(design, model)
    common.emit(args, report, render(report))
    return 0
