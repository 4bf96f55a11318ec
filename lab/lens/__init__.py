"""The tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the Tuned
Lens", arXiv:2303.08112): per block, an affine translator of the stream, fitted so that the model's own
read-out of the translated stream matches its final distribution. Early exit through it reads the
middle of a model trained the ordinary way far better than the logit lens (``exit=E`` read out as is).

    lens, _ = find_tuned_lens("builtin", model)      # fitted by `blocklab lens fit --model builtin`
    logits = model.unembed(lens(5, stream))          # exit=6: the stream leaving block 5, translated

- ``lab.lens.translator``: ``TunedLens`` (the translators), ``ReadOut`` (the read-out over the rows a
  model reads), the file ``tuned_lens.safetensors`` and its checks;
- ``lab.lens.home``: where a model's lens is kept (``lens_home``) and found (``find_tuned_lens``);
- ``lab.lens.data``: the calibration and held-out windows of text, and the streams the model leaves;
- ``lab.lens.fit``: fitting with the model frozen (``fit_tuned_lens``), resumable;
- ``lab.lens.report``: per block, loss, KL and top-1 agreement with either lens (``blocklab lens report``);
- ``lab.lens.cost``: a translator's weights and time against a block's (``blocklab lens cost``);
- ``lab.lens.cli``: ``blocklab lens fit|report|cost``.
"""

from lab.lens.home import find_tuned_lens, lens_home
from lab.lens.translator import FILE, TunedLens, check_fits, load_tuned_lens, save_tuned_lens

__all__ = [
    "FILE",
    "TunedLens",
    "check_fits",
    "find_tuned_lens",
    "lens_home",
    "load_tuned_lens",
    "save_tuned_lens",
]
