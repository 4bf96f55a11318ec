"""Self-speculative decoding of one sequence (LayerSkip, Elhoushi et al. 2024): ``speculate=E`` sets.

Each round the set's blocks below ``speculate`` draft up to ``draft_tokens`` tokens one at a time,
read out through ``ln_f`` and the unembedding (under ``lens=tuned``, after the tuned lens's translator
of the last drafting block: a better guess of the full set's token for one D x D product); the
remaining blocks then verify every drafted
position in one pass, continuing the draft's streams and keys and values (the first blocks never
run twice). Greedy: the drafts up to the first the full model disagrees with, then the full model's
token there (or after the last draft). Sampling: speculative sampling's rule (accept a draft d with
probability min(1, p(d)/q(d)), else draw from max(0, p - q) normalised), so tokens are distributed as
the full set's. The keys and values of rejected drafts are left past the cache's length and
overwritten later. On a model with ``lab.fast``'s compiled steps, the drafts and the verification
run as compiled graphs (``FastDecode.draft``, ``feed`` and ``verify``) on the decoder's cache;
eager, on a float32 model whose blocks lab.intmm computes, a ``vocab=N`` draft step is one C call
(``lab.block_kernel.DraftKernel``) and the verification's blocks another (``GPT.run_stack``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.block_kernel import DraftKernel
from lab.blocks import BlockSet
from lab.decode import Decoder
from lab.errors import UserError
from lab.lens.translator import exit_translator, require_tuned_lens, translate_exits
from lab.model import GPT
from lab.sampling import SamplingParams, draw, greedy_token, pick_token, token_logprob, token_probabilities


@dataclass
class SpeculationStats:
    """What self-speculative decoding did for one sequence."""

    rounds: int = 0
    """Verification passes."""
    drafted: int = 0
    accepted: int = 0
    """Drafted tokens the full model agreed with."""

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class DraftVocabulary:
    """The tokens drafts are read out over under ``vocab=N``: the first N of the model's tuned-lens
    ranking (``TunedLens.ranking``: the tokens its final read-out predicts on the calibration text,
    the most often most likely first), their rows of the token table copied together. FR-Spec's draft
    vocabulary (Zhao et al. 2025): a draft's read-out multiplies N rows instead of the whole table;
    a token outside them is never drafted, and the verification, which reads every token, keeps the
    output the full set's."""

    def __init__(self, model: GPT, size: int):
        lens = model.tuned_lens
        if lens is None or lens.ranking is None:
            lacks = "has no tuned lens" if lens is None else "has a lens fitted before lenses recorded one"
            raise UserError(
                "blocks: vocab=N drafts over the ranking of final tokens the model's tuned lens records, "
                f"and this model {lacks}: fit one with `blocklab lens fit --model MODEL` (MODEL as you "
                "load it), then load the model again"
            )
        weight = model.wte.weight
        self.tokens = lens.ranking[:size].to(weight.device)  # [N] token ids
        self.table = weight[self.tokens].contiguous()  # [N, D]
        bias = model.logit_bias  # [V] or None
        self.bias = weight.new_zeros(len(self.tokens)) if bias is None else bias[self.tokens].to(weight.dtype)
        self.vocab_size = model.config.vocab_size

    def token(self, logits: torch.Tensor) -> int:
        """The most likely token of a draft's logits [N]."""
        return int(self.tokens[greedy_token(logits)])

    def probabilities(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """The distribution a draft is drawn from, over every token [V] (none outside the vocabulary),
        from its logits [N]."""
        full = logits.new_full((self.vocab_size,), float("-inf")).index_copy_(0, self.tokens, logits)  # [V]
        return token_probabilities(full, sampling)


class Speculator:
    """The draft and verification passes of one sequence; see the module docstring."""

    def __init__(self, model: GPT, block_set: BlockSet, max_len: int):
        self.model = model
        self.k = block_set.draft_tokens
        self.decoder = Decoder(model, block_set.without_speculation(), max_len=max_len)
        # lab.fast: compiled drafts and verifications (on the decoder's cache), where the mode allows
        self.fast = (
            self.decoder.fast if self.decoder.fast is not None and model.fast.takes(block_set) else None
        )
        self.draft_blocks = [i for i in self.decoder.blocks if i < block_set.speculate]
        self.verify_blocks = [i for i in self.decoder.blocks if i >= block_set.speculate]
        self.lens = require_tuned_lens(model, block_set)  # the drafts' read-out (None: the logit lens)
        self.draft_exit = [exit_translator(self.lens, self.draft_blocks)]
        size = block_set.draft_vocabulary
        self.vocabulary = None if size is None else DraftVocabulary(model, size)
        self.draft_kernel = None  # the eager draft step in one call (lab.block_kernel), where it takes it
        if self.vocabulary is not None:
            table, bias = self.vocabulary.table, self.vocabulary.bias
            self.draft_kernel = DraftKernel.build(model, self.lens, self.draft_exit[0], table, bias)
        self.overwrite = block_set.overwrite
        self.stats = SpeculationStats()

    def _through(self, blocks: list[int], x: torch.Tensor, pos: int) -> torch.Tensor:
        """The stream x [1, T, D] at positions pos.. through ``blocks``, writing their keys and values."""
        return self.model.run_blocks(x, blocks, self.decoder.cache, pos, self.overwrite)  # [1, T, D]

    @torch.inference_mode()
    def round(
        self, last: int, wanted: int, sampling: SamplingParams, generator: torch.Generator
    ) -> list[tuple[int, float]]:
        """Feed ``last``; the next tokens (1 to ``wanted``, at most k + 1) and their log-probabilities
        under the full set."""
        decoder = self.decoder
        start = decoder.position
        k = min(self.k, wanted - 1, decoder.cache.max_len - start - 1)
        if k <= 0:  # no room to draft: one plain step
            logits, _ = decoder.step(last)
            logits = logits.float()
            token = pick_token(logits, sampling, generator)
            return [(token, token_logprob(logits, token))]
        fast = self.fast if self.fast is not None and self.fast.ready() else None
        streams, drafts, draft_probs = self._draft(last, start, k, sampling, generator, fast)
        fed = torch.cat(streams, dim=1)  # [1, k+1, D]
        if fast is not None:
            target = fast.verify(self.verify_blocks, self.overwrite, decoder.cache, fed, start).float()
        else:
            target = self.model.unembed(self._through(self.verify_blocks, fed, start))[0].float()
        # target [k+1, V]: the full set's logits after each input
        out = self._verify(target, drafts, draft_probs, sampling, generator)
        self.stats.rounds += 1
        self.stats.drafted += k
        self.stats.accepted += len(out) - 1
        decoder.cache.length = start + len(out)  # the inputs kept: last and the accepted drafts
        return out

    def _draft(
        self, last: int, start: int, k: int, sampling: SamplingParams, generator: torch.Generator, fast
    ):
        """k drafted tokens after ``last``; the streams [1, 1, D] leaving the draft blocks for ``last``
        and each draft, and the distribution each draft was drawn from (sampling only). ``fast``: the
        model's ``lab.fast.FastDecode``, whose compiled steps draft (None: eager)."""
        streams, drafts, draft_probs = [], [], []
        token = last
        for j in range(k + 1):  # the last draft is fed too: verification reads the full model after it
            if j == k:
                streams.append(self._feed(token, start + j, fast))
                break
            stream, logits = self._draft_step(token, start + j, fast)
            streams.append(stream)
            vocabulary = self.vocabulary
            if sampling.temperature == 0.0:
                token = greedy_token(logits) if vocabulary is None else vocabulary.token(logits)
            else:
                draft_probs.append(
                    token_probabilities(logits, sampling)
                    if vocabulary is None
                    else vocabulary.probabilities(logits, sampling)
                )
                token = draw(draft_probs[-1], generator)
            drafts.append(token)
        return streams, drafts, draft_probs

    def _feed(self, token: int, pos: int, fast) -> torch.Tensor:
        """``token`` at ``pos`` through the draft blocks: the stream leaving them [1, 1, D]."""
        if fast is not None:
            return fast.feed(self.draft_blocks, self.overwrite, self.decoder.cache, token, pos)
        if self.draft_kernel is not None:
            cache, blocks = self.decoder.cache, self.draft_blocks
            fed = self.draft_kernel(self.model, blocks, cache, token, pos, self.overwrite, read=False)
            if fed is not None:
                return fed[0]
        return self._feed_eager(token, pos)

    def _feed_eager(self, token: int, pos: int) -> torch.Tensor:
        """``_feed`` through the modules' own path: the stream leaving the draft blocks [1, 1, D]."""
        x = self.model.embed_tokens(torch.tensor([[token]], device=self.model.wte.weight.device), pos)
        return self._through(self.draft_blocks, x, pos)  # [1, 1, D]

    def _draft_step(self, token: int, pos: int, fast) -> tuple[torch.Tensor, torch.Tensor]:
        """``_feed``, and the draft's read-out of the stream (the tuned lens's, under lens=tuned):
        the stream [1, 1, D] and the logits in float32, [V] or [N] over the draft vocabulary."""
        rows = None if self.vocabulary is None else (self.vocabulary.table, self.vocabulary.bias)
        if fast is not None:
            cache = self.decoder.cache
            stream, logits = fast.draft(
                self.draft_blocks, self.overwrite, cache, token, pos, self.draft_exit[0], rows
            )
            return stream, logits.float()
        if self.draft_kernel is not None:
            cache = self.decoder.cache
            drafted = self.draft_kernel(self.model, self.draft_blocks, cache, token, pos, self.overwrite)
            if drafted is not None:
                return drafted
        stream = self._feed_eager(token, pos)  # the one call did not take it: the eager draft
        read = translate_exits(self.lens, stream, self.draft_exit)  # [1, 1, D]
        if rows is not None:
            return stream, self.model.unembed_rows(read, *rows).float()  # [N]
        return stream, self.model.unembed(read)[0, -1].float()  # [V]

    def _verify(
        self,
        target: torch.Tensor,
        drafts: list[int],
        draft_probs: list[torch.Tensor],
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> list[tuple[int, float]]:
        """The tokens the full set's logits ``target`` [k+1, V] keep: accepted drafts, then one of its own."""
        greedy = sampling.temperature == 0.0

        def logprob(j: int, token: int) -> float:  # as a plain step has it; only the positions kept
            return token_logprob(target[j], token)

        out = []
        for j, draft in enumerate(drafts):
            if greedy:
                agreed = greedy_token(target[j]) == draft
            else:
                p, q = token_probabilities(target[j], sampling), draft_probs[j]
                u = float(torch.rand((), generator=generator, device=target.device))
                agreed = u * float(q[draft]) < float(p[draft])  # u < p/q, without dividing by 0
            if agreed:
                out.append((draft, logprob(j, draft)))
                continue
            if greedy:
                token = greedy_token(target[j])
            else:
                residual = (p - q).clamp(min=0.0)  # draw needs no total of 1
                token = draw(residual if float(residual.sum()) > 0 else p, generator)
            out.append((token, logprob(j, token)))
            return out
        token = pick_token(target[len(drafts)], sampling, generator)  # every draft agreed: one more free
        out.append((token, logprob(len(drafts), token)))
        return out
