"""``blocklab stall``: the post-LN warmup stall, reproduced.

    blocklab stall --preset cpu
    blocklab stall --preset gpu --seeds 1 2 3 --out runs/stall-gpu
    blocklab stall --variants pre post post+warmup=100 deepnorm peri peri+rms
    blocklab stall --grid lr=5e-4,1e-3,2e-3 warmup=0,25,100 --variants post --out runs/grid
    blocklab stall --at-init 6 12 24 48 --variants pre post deepnorm peri   # no training: Xiong's figure
    blocklab stall --config my_preset.yaml                                 # settings from a YAML file

For each seed, six-block character-level models are trained with the same settings but for the
variant (where the norms sit, their type, the warmup); by default pre-LN without warmup, post-LN
without warmup, post-LN with a linear warmup. Without warmup the post-LN model stays on the unigram line
(it predicts character frequencies and never learns to use context) while pre-LN goes below the
bigram line; with warmup post-LN breaks through as well. Before training, each model's per-block
gradient norms at initialisation are measured (Xiong et al. 2020's figure).

Writes ``OUT/<run>/`` TensorBoard runs, ``OUT/summary.json``, ``OUT/stall.png`` (loss curves) and
``OUT/grad_norms.png`` (gradient norm per block at init), and prints a table. ``--grid`` instead trains
one variant over a grid of preset settings, cell by cell (a rerun skips the cells already in
``OUT/cells/``), and writes ``OUT/grid.json`` and the heatmap ``OUT/grid.png``.
"""

# The modules, in the order a run goes through them: settings (the preset, read from
# configs/stall/NAME.yaml, the variants, the grid's axes), experiment (the training runs), report
# (statistics and tables), plots, cli (the command).
