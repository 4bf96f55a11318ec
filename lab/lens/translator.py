"""The tuned lens's translators, the read-out they feed, and where a model's lens is kept.

A translator maps the stream leaving block i to an estimate of the stream leaving the last block,
``translate(h) = h + h A_i + b_i`` (A_i [D, D] zero and b_i zero at start: the identity, so an
untrained lens is the logit lens), or at rank r ``h + (h U_i) V_i + b_i``. The model's own read-out
(``GPT.unembed``: the final norm ``ln_f``, then the token table) then reads the translated stream, as in
Belrose et al. 2023: ``unembed(lens(i, stream))``. The residual form is theirs too (``tuned_lens``
0.2.0's ``transform_hidden``): weight decay pulls a translator towards the identity, not towards zero.

The lens is tensors, not a module of the model (like ``lab.exit_probe.ExitProbe``): the model's weights
files and state dict stay the model's alone, and a lens is fitted, saved and loaded on its own
(``tuned_lens.safetensors``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lab.blocks import BlockSet
from lab.errors import UserError
from lab.model import GPT
from lab.rows import matmul_rows_alone, taking_rows_alone

FILE = "tuned_lens.safetensors"
FORMAT = "blocklab-tuned-lens"


def _product(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2d [N, Din] @ weight [Din, Dout] -> [N, Dout]; each row alone under ``lab.rows.rows_alone``
    (batch invariance), and one row as a matrix-vector product, as ``lab.model.Linear`` multiplies."""
    if x2d.size(0) == 1:
        return torch.mv(weight.t(), x2d[0])[None]  # [1, Dout]
    if taking_rows_alone():
        return matmul_rows_alone(x2d, weight, None)  # [N, Dout]
    return x2d @ weight  # [N, Dout]


@dataclass
class TunedLens:
    """Per block i of L, a translator of the stream leaving it: ``h + h weight[i] + bias[i]`` at full
    rank, ``h + (h down[i]) up[i] + bias[i]`` at rank r. Only ``blocks`` were fitted; the others
    (the last block always: its stream is what the others are fitted to) stay the identity."""

    bias: torch.Tensor
    """[L, D]"""
    weight: torch.Tensor | None = None
    """[L, D, D] (in, out), full rank; None at low rank."""
    down: torch.Tensor | None = None
    """[L, D, r] at rank r."""
    up: torch.Tensor | None = None
    """[L, r, D] at rank r."""
    blocks: tuple[int, ...] = ()
    """The blocks whose translators were fitted."""
    ranking: torch.Tensor | None = None
    """[R] token ids the final read-out predicts on the calibration text: those it most often makes the
    most likely first, then the rest by the probability it gives them (``lab.lens.fit.top1_ranking``);
    the draft vocabulary of ``speculate=E;vocab=N`` is its first N (``lab.speculate``)."""
    metadata: dict = field(default_factory=dict)
    """What the file records: the calibration text's fingerprint, steps, held-out KL per block, ..."""

    @classmethod
    def identity(cls, n_layer: int, width: int, rank: int | None = None) -> TunedLens:
        """Every translator the identity (the logit lens), at full rank or at rank r."""
        bias = torch.zeros(n_layer, width)
        if rank is None:
            return cls(bias=bias, weight=torch.zeros(n_layer, width, width))
        return cls(bias=bias, down=torch.zeros(n_layer, width, rank), up=torch.zeros(n_layer, rank, width))

    @property
    def n_layer(self) -> int:
        return self.bias.size(0)

    @property
    def width(self) -> int:
        return self.bias.size(1)

    @property
    def rank(self) -> int | None:
        """None at full rank."""
        return None if self.weight is not None else self.down.size(2)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The parameters by name: weight and bias, or down, up and bias."""
        names = ("weight", "bias") if self.weight is not None else ("down", "up", "bias")
        return {name: getattr(self, name) for name in names}

    def __call__(self, block: int, stream: torch.Tensor) -> torch.Tensor:
        """The stream leaving ``block`` [..., D] translated -> [..., D], for ``GPT.unembed``: one D x D
        product per row at full rank (two D x r ones at rank r)."""
        *lead, D = stream.shape
        x = stream.reshape(-1, D)  # [N, D]
        if self.weight is not None:
            delta = _product(x, self.weight[block])  # [N, D]
        else:
            delta = _product(_product(x, self.down[block]), self.up[block])  # [N, r] -> [N, D]
        return (x + delta + self.bias[block]).view(*lead, D)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> TunedLens:
        moved = {name: tensor.to(device=device, dtype=dtype) for name, tensor in self.tensors().items()}
        ranking = None if self.ranking is None else self.ranking.to(device)  # ids stay integers
        return TunedLens(**moved, blocks=self.blocks, ranking=ranking, metadata=self.metadata)


# ---------------------------------------------------------------------------------------------------
# Exits through the lens (block sets with lens=tuned)


def require_tuned_lens(model: GPT, block_set: BlockSet) -> TunedLens | None:
    """The lens ``block_set`` reads its exits through: the model's (``GPT.tuned_lens``, attached by
    ``lab.weights.load_model``) under ``lens=tuned``, None under the logit lens. UserError saying how
    to fit one when the set asks for it and the model has none."""
    if block_set.lens != "tuned":
        return None
    if model.tuned_lens is None:
        raise UserError(
            "blocks: lens=tuned needs the model's tuned lens and this model has none; fit one with "
            "`blocklab lens fit --model MODEL` (MODEL as you load it), then load the model again"
        )
    return model.tuned_lens


def exit_translator(lens: TunedLens | None, blocks_ran: list[int]) -> int | None:
    """The block whose translator reads a stream that ran ``blocks_ran``: the last of them. None (read
    out as it is) without a lens, when no block ran, or when that block has no fitted translator (the
    final block never has one: its stream is what the translators are fitted to)."""
    if lens is None or not blocks_ran or blocks_ran[-1] not in lens.blocks:
        return None
    return blocks_ran[-1]


def translate_exits(lens: TunedLens | None, x: torch.Tensor, exits: list[int | None]) -> torch.Tensor:
    """x [N, ..., D] with each row n translated by the translator of block ``exits[n]`` (None: as it
    is), for the read-out. The rows of one block share a call, whose product takes each row alone
    under ``lab.rows.rows_alone`` (``_product``); rows read out as they are cost nothing."""
    for block in sorted({e for e in exits if e is not None}):
        rows = [n for n, e in enumerate(exits) if e == block]
        if len(rows) == len(exits):
            return lens(block, x)
        index = torch.tensor(rows, device=x.device)
        x = x.index_copy(0, index, lens(block, x[index]))  # [N, ..., D]
    return x


# ---------------------------------------------------------------------------------------------------
# The read-out, over the rows the model reads


class ReadOut:
    """``GPT.unembed``'s distribution computed over the token rows the model reads (``GPT.read_rows``,
    the builtin models' ~18.8k of GPT-2's 50257), the others pooled into one last column.

    Every other row is zero, so its logit is its ``logit_bias`` whatever the stream, the same under
    any lens: pooling them into one category of logit ``logsumexp`` of those biases leaves the
    normaliser, and with it each read row's probability, KL between two read-outs and the top-1, as
    they are, at a third of the cost. A model that reads every row gets no pooled column.
    """

    def __init__(self, model: GPT):
        V = model.config.vocab_size
        device = model.wte.weight.device
        self.ln_f = model.ln_f
        self.rows = model.read_rows if model.read_rows is not None else torch.arange(V, device=device)
        bias = model.logit_bias if model.logit_bias is not None else torch.zeros(V, device=device)
        self.bias = bias.detach().float()  # [V]
        self.unread = torch.ones(V, dtype=torch.bool, device=device)  # [V]
        self.unread[self.rows] = False
        self.pooled = torch.logsumexp(self.bias[self.unread], 0) if bool(self.unread.any()) else None
        table, row_bias = model.wte.weight[self.rows].detach(), self.bias[self.rows]  # [V_read, D], [V_read]
        if self.pooled is not None:  # the pooled column: a zero row whose bias is the pooled logit
            table = torch.cat([table, table.new_zeros(1, table.size(1))])  # [V_read + 1, D]
            row_bias = torch.cat([row_bias, self.pooled[None]])  # [V_read + 1]
        self.table, self.row_bias = table, row_bias.to(table.dtype)
        self.column = torch.full((V,), -1, dtype=torch.long, device=device)  # [V]: token -> its column
        self.column[self.rows] = torch.arange(len(self.rows), device=device)

    def logits(self, stream: torch.Tensor) -> torch.Tensor:
        """stream [..., D] -> logits [..., C]: the read rows', then the pooled column (if any)."""
        return F.linear(self.ln_f(stream), self.table, self.row_bias)  # [..., C]

    def token_log_probs(self, log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log P(target) [...] from ``log_softmax(logits)`` [..., C] and GPT-2 ids ``targets`` [...]: a
        read row's column, or an unread token's share of the pooled column."""
        column = self.column[targets]  # [...]
        read = log_probs.gather(-1, column.clamp(min=0)[..., None])[..., 0]  # [...]
        if self.pooled is None:
            return read
        unread = log_probs[..., -1] + self.bias[targets] - self.pooled  # [...]
        return torch.where(column >= 0, read, unread)

    def top1(self, logits: torch.Tensor) -> torch.Tensor:
        """The GPT-2 id of the most likely token [...], from ``logits`` [..., C]."""
        best_read, column = logits[..., : len(self.rows)].max(-1)  # [...] each
        top = self.rows[column]  # [...]
        if self.pooled is None:
            return top
        best_bias, best_unread = self.bias.masked_fill(~self.unread, float("-inf")).max(0)
        return torch.where(best_read >= best_bias, top, best_unread)


# ---------------------------------------------------------------------------------------------------
# Files


def model_fingerprint(model: GPT) -> str:
    """sha256 of the model's token and position tables and final norm, rounded to bf16: the same
    whatever dtype the model was loaded in, and another once it is retrained (a lens fitted to other
    weights of the same shape must not be applied silently)."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):  # ln_f: none after post-LN
        if name in state:
            values = state[name].detach().to("cpu", torch.bfloat16).contiguous()
            digest.update(name.encode() + values.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def save_tuned_lens(lens: TunedLens, directory: Path) -> Path:
    """Written through a temporary name then renamed (as ``lab.weights.save_model``); returns the file.
    The metadata are JSON values, each stored as a string (safetensors' metadata are strings)."""
    path = Path(directory) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(FILE + ".tmp")
    metadata = {"format": FORMAT, "blocks": lens.blocks, "rank": lens.rank, **lens.metadata}
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in lens.tensors().items()}
    if lens.ranking is not None:
        tensors["ranking"] = lens.ranking.cpu()
    save_file(tensors, str(temporary), metadata={key: json.dumps(value) for key, value in metadata.items()})
    temporary.replace(path)
    return path


def load_tuned_lens(directory: Path, model: GPT | None = None) -> TunedLens | None:
    """The lens saved in ``directory``, or None when there is none; checked against ``model``
    (``check_fits``) when one is given."""
    path = Path(directory) / FILE
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as handle:
        metadata = {key: json.loads(value) for key, value in (handle.metadata() or {}).items()}
    tensors = load_file(str(path))
    if metadata.pop("format", None) != FORMAT:
        raise UserError(f"{path}: not a blocklab tuned lens")
    blocks, _ = tuple(metadata.pop("blocks")), metadata.pop("rank", None)
    lens = TunedLens(**tensors, blocks=blocks, metadata=metadata)  # a lens fitted before rankings: None
    if model is not None:
        check_fits(lens, model, str(path))
    return lens


def check_fits(lens: TunedLens, model: GPT, source: str = "tuned lens") -> None:
    """UserError unless ``lens`` has a translator per block of ``model`` at its width and was fitted to
    this model's weights (``model_fingerprint``)."""
    wanted = (model.config.n_layer, model.config.n_embd)
    if (lens.n_layer, lens.width) != wanted:
        raise UserError(
            f"{source}: a lens for {(lens.n_layer, lens.width)} (blocks, width), the model is {wanted}; "
            "fit one for it with `blocklab lens fit`"
        )
    fitted_to = lens.metadata.get("model_fingerprint")
    if fitted_to is not None and fitted_to != model_fingerprint(model):
        raise UserError(
            f"{source}: fitted to other weights of this shape (a retrained model?); fit it again with "
            "`blocklab lens fit`"
        )
