"""blocklab shapes: run one Block and name its six tensors, with shapes, parameters and what mixes positions.

    blocklab shapes                         # GPT-2 small's shapes, batch 1, T = 1024
    blocklab shapes --config gpt2-xl --T 256

The Block is built from the config with random weights (shapes do not depend on the values), fed a
random stream, and its tensors are captured by name through ``lab.hooks.capture``: the shapes printed
are the shapes that ran. Only attention mixes positions; everything else works on each position alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from jsonargparse.typing import PositiveInt

from lab import flags
from lab.analysis import common
from lab.hooks import capture
from lab.model import Block


def _params(*modules: torch.nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def tensor_specs(block: Block, T: int) -> list[tuple]:
    """The six tensors of ``block`` at T positions: what each is, its hook name, its symbolic shape, what
    makes it (and the modules whose weights do), its FLOPs per token, whether it mixes positions.
    (Pre-LN: each stage's LayerNorm sits on its input; post-LN: on the sum, i.e. the next stream.)"""
    attn, mlp = block.attn, block.mlp
    D = attn.c_proj.weight.shape[1]
    pre = block.norm_first  # peri as well: the stage reads ln_1(x)
    return [
        ("the stream entering", "resid_pre", "[B, T, D]", "-", [], 0, False),
        (
            "q, k, v projections",
            "attn.qkv",
            "[B, T, 3D] -> 3 x [B, H, T, Dh]",
            "ln_1 + attn.c_attn" if pre else "attn.c_attn",
            [block.ln_1, attn.c_attn] if pre else [attn.c_attn],
            2 * D * 3 * D,
            False,
        ),
        (
            "attention scores",
            "attn.scores",
            "[B, H, T, T]",
            "- (q·k^T / sqrt(Dh), masked)",
            [],
            2 * T * D,
            True,
        ),
        (
            "attention's output",
            "attn_out",
            "[B, T, D]",
            "attn.c_proj (after softmax(scores)·v)",
            [attn.c_proj],
            2 * T * D + 2 * D * D,
            True,
        ),
        (
            "feed-forward hidden",
            "mlp.hidden",
            "[B, T, 4D]",
            "ln_2 + mlp.c_fc, GELU" if pre else "mlp.c_fc, GELU",
            [block.ln_2, mlp.c_fc] if pre else [mlp.c_fc],
            2 * D * 4 * D,
            False,
        ),
        ("feed-forward output", "mlp_out", "[B, T, D]", "mlp.c_proj", [mlp.c_proj], 2 * 4 * D * D, False),
    ]


def describe(block: Block, batch: int, T: int) -> dict:
    """Run ``block`` on a random [batch, T, D] stream and describe its six named tensors."""
    attn = block.attn
    D, H, Dh = attn.c_proj.weight.shape[1], attn.n_head, attn.head_dim
    spec = tensor_specs(block, T)
    x = torch.randn(batch, T, D)  # [B, T, D]
    with torch.inference_mode(), capture(block, [name for _, name, *_ in spec]) as seen:
        block(x)
    rows = []
    for what, name, symbolic, made_by, modules, flops, mixes in spec:
        tensor = seen[name]
        rows.append(
            {
                "tensor": what,
                "hook": name,
                "shape": list(tensor.shape),
                "symbolic": symbolic,
                "made_by": made_by,
                "params": _params(*modules),
                "flops_per_token": flops,
                "mixes_positions": mixes,
                "MiB": tensor.numel() * tensor.element_size() / 2**20,
            }
        )
    return {
        "B": batch,
        "T": T,
        "D": D,
        "H": H,
        "Dh": Dh,
        "norm": block.norm,
        "block_params": _params(block),
        "rows": rows,
    }


def render(report: dict, name: str) -> str:
    columns = [
        "tensor",
        "hook",
        "shape",
        "symbolic",
        "made by",
        "params",
        "FLOPs/token",
        "mixes positions",
        "MiB",
    ]
    lines = [
        [
            r["tensor"],
            r["hook"],
            str(r["shape"]),
            r["symbolic"],
            r["made_by"],
            r["params"],
            r["flops_per_token"],
            "yes" if r["mixes_positions"] else "no",
            r["MiB"],
        ]  # fmt: skip
        for r in report["rows"]
    ]
    flops = sum(r["flops_per_token"] for r in report["rows"])
    return "\n".join(
        [
            f"shapes: one Block of {name}, B={report['B']} T={report['T']} D={report['D']} "
            f"H={report['H']} Dh={report['Dh']} ({report['norm']}-LN), {report['block_params']:,} parameters",
            "",
            common.table(columns, lines),
            "",
            f"FLOPs per token in this Block: {flops:,} = 24D^2 + 4TD (matmuls only, full T x T)",
            "Only attention mixes positions: the scores compare each query with every earlier key, and "
            "attention's output sums values across positions. The projections, LayerNorms and the "
            "feed-forward act on each position alone.",
        ]
    )


@dataclass
class ShapesOptions:
    """The six tensors of one Block with their shapes and parameters."""

    T: PositiveInt | None = None
    """Positions (default: the config's context length)."""
    batch: PositiveInt = 1
    """Batch size B."""


def parser() -> flags.Parser:
    p = common.parser("shapes", "The six tensors of one Block, with shapes, parameters and position mixing.")
    common.add_config_args(p)
    p.add_options(ShapesOptions)
    common.add_output_args(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])

    cfg = common.config_from_args(args)
    T = args.T or cfg.block_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(replace(cfg, dropout=0.0)).eval()
    report = describe(block, args.batch, T)
    report["config"] = common.config_name(args)
    common.emit(args, report, render(report, report["config"]))
    return 0
