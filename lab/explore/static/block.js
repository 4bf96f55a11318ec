// The Block: its six tensors (blocklab shapes) and the model's FLOPs per token at T (blocklab flops).
import { api, chart, commandLine, fill, fmt, h, legend, line, pct, s, whole } from "./lib.js";

let selected = "attn.scores";
let latest = null;

/** The slider's T values: 1, 2, 3, 4, 6, 8, 12, ... up to ``max``, and the model's context. */
function tValues(context, max) {
  const values = new Set([context]);
  for (let p = 1; p <= max; p *= 2) {
    values.add(p);
    if (3 * p <= max) values.add(3 * p);
  }
  return [...values].sort((a, b) => a - b);
}

const shapeText = (shape) => `[${shape.join(", ")}]`; // as the CLI prints a list

/** What makes a tensor, for the arrow into it: "- (q·k^T ...)" (no weights) reads "q·k^T ... (no weights)". */
const operation = (madeBy) => (madeBy.startsWith("- (") ? `${madeBy.slice(3, -1)}, no weights` : madeBy);

const joins = { "attn_out": "added to the stream: resid_mid", "mlp_out": "added to the stream: resid_post" };

function diagram(report) {
  const D = report.D;
  return report.rows.map((row) => {
    const width = Math.min(1, row.shape[row.shape.length - 1] / (4 * D)); // the last dimension, to 4D
    const box = h("button", {
      type: "button",
      class: `tensor${row.mixes_positions ? " mixes" : ""}`,
      "data-hook": row.hook,
      "aria-pressed": String(row.hook === selected),
      onclick: () => {
        selected = row.hook;
        draw(latest);
      },
    },
    h("span", { class: "hook" }, row.hook),
    h("span", { class: "shape" }, `${row.symbolic}  =  ${shapeText(row.shape)}`));
    box.style.width = `${30 + 70 * width}%`;
    return [
      h("div", { class: "op" }, row.made_by === "-" ? row.tensor : `↓ ${operation(row.made_by)}`),
      box,
      joins[row.hook] ? h("div", { class: "op join" }, "⊕ ", joins[row.hook]) : null,
    ];
  });
}

function detail(report) {
  const row = report.rows.find((r) => r.hook === selected) || report.rows[0];
  const entries = [
    ["tensor", row.tensor, "tensor"],
    ["hook", row.hook, "hook"],
    [`shape (B = ${report.B}, T = ${fmt(report.T)})`, shapeText(row.shape), "shape"],
    ["symbolic shape", row.symbolic, "symbolic"],
    ["made by", row.made_by, "made_by"],
    ["parameters", fmt(row.params), "params"],
    ["FLOPs per token", fmt(row.flops_per_token), "flops_per_token"],
    ["mixes positions", row.mixes_positions ? "yes" : "no", "mixes_positions"],
    ["MiB", fmt(row.MiB), "MiB"],
  ];
  const flops = report.rows.reduce((sum, r) => sum + r.flops_per_token, 0);
  return [
    h("h3", {}, row.tensor),
    h("dl", { class: "facts" }, entries.map(([name, value, key]) => [h("dt", {}, name), h("dd", { "data-key": key }, value)])),
    h("p", { class: "note" },
      `One Block (D = ${report.D}, H = ${report.H}, Dh = ${report.Dh}, ${report.norm}-LN): `,
      h("span", { "data-key": "block_params" }, fmt(report.block_params)), " parameters; ",
      h("span", { "data-key": "block_flops" }, fmt(flops)),
      " FLOPs per token = 24D² + 4TD (matmuls only, full T × T). Only attention mixes positions."),
  ];
}

function flopsPanel(data) {
  const report = data.flops;
  const row = report.rows[0];
  const parts = [
    ["linear", "Blocks' linear, 2N_blocks"],
    ["unembedding", "unembedding, 2Vd"],
    ["attention", "attention, 4LTd"],
  ];
  const bar = h("div", { class: "stacked", role: "img", "aria-label": "shares of a token's forward FLOPs" },
    parts.map(([key]) => {
      const part = h("span", { class: `part ${key}` });
      part.style.width = `${(100 * row[key]) / row.total}%`;
      return part;
    }));
  const curve = data.curve.rows;
  const c = chart({
    x: { type: "log", domain: [curve[0].T, curve[curve.length - 1].T], label: "T (positions attended to)" },
    y: { type: "linear", domain: [0, 1], label: "attention's share", tickFormat: (t) => pct(t, 0) },
    title: "attention's share of a token's forward FLOPs, against T",
  });
  c.svg.append(line(c, curve.map((r) => [r.T, r.attention_share]), "series attention"));
  for (const [T, cls, text] of [[report.crossover_T_blocks, "crossover", "attention = Blocks' linear"], [row.T, "current", `T = ${fmt(row.T)}`]]) {
    if (T < curve[0].T || T > curve[curve.length - 1].T) continue;
    c.svg.append(s("g", { class: cls }, s("line", { x1: c.x(T), x2: c.x(T), y1: c.top, y2: c.bottom }),
      s("text", { x: c.x(T) + 4, y: cls === "current" ? c.top + 12 : c.top + 26 }, text)));
  }
  return [
    h("h3", {}, `The whole model at T = ${fmt(row.T)}: forward FLOPs per token`),
    h("dl", { class: "facts wide" },
      parts.map(([key, name]) => [h("dt", {}, h("span", { class: `swatch ${key}` }), name), h("dd", { "data-key": key }, fmt(row[key]))]),
      h("dt", {}, "total, 2N + 4LTd"), h("dd", { "data-key": "total" }, fmt(row.total)),
      h("dt", {}, "attention's share"), h("dd", { "data-key": "attention_share" }, pct(row.attention_share))),
    bar,
    h("p", {}, "attention's 4·L·T·d overtakes the Blocks' linear layers at T = ",
      h("strong", { "data-key": "crossover_T_blocks" }, whole(report.crossover_T_blocks)),
      ", and all linear layers (unembedding included) at T = ",
      h("strong", { "data-key": "crossover_T_all_linear" }, whole(report.crossover_T_all_linear)), "."),
    c.svg,
    commandLine(data.commands.shapes, data.commands.flops),
  ];
}

function draw(data) {
  const report = data.shapes;
  fill(document.getElementById("block-diagram"),
    ...diagram(report).flat().filter(Boolean),
    legend([["mixes", "mixes positions (attention)"], ["plain", "each position alone"]]),
    h("p", { class: "note" }, "Box widths follow each tensor's last dimension, up to 4D."),
  );
  fill(document.getElementById("tensor-detail"), ...detail(report));
  fill(document.getElementById("flops-panel"), ...flopsPanel(data));
  document.getElementById("view-block").dataset.t = String(report.T); // what the test waits for
}

export async function showBlock(info) {
  const slider = document.getElementById("t-slider");
  const input = document.getElementById("t-input");
  const values = tValues(info.config.block_size, info.T_max);
  slider.max = String(values.length - 1);
  input.max = String(info.T_max);
  let wanted = null;
  let busy = false;
  // The newest T wins: while one request is out, later moves only replace the T asked for next.
  async function setT(T) {
    wanted = T;
    if (busy) return;
    busy = true;
    try {
      while (wanted !== null) {
        const next = wanted;
        wanted = null;
        latest = await api(`/api/block?T=${next}`);
        if (wanted === null) draw(latest);
      }
    } finally {
      busy = false;
    }
  }
  const nearest = (T) => values.reduce((best, v, i) => (Math.abs(v - T) < Math.abs(values[best] - T) ? i : best), 0);
  const show = (T) => {
    input.value = String(T);
    slider.setAttribute("aria-valuetext", `T = ${T}`); // a screen reader says T, not the slider's index
  };
  slider.addEventListener("input", () => {
    show(values[+slider.value]);
    setT(values[+slider.value]);
  });
  input.addEventListener("change", () => {
    const T = Math.max(1, Math.min(info.T_max, Math.round(+input.value) || 1));
    show(T);
    slider.value = String(nearest(T));
    setT(T);
  });
  const T = info.config.block_size;
  slider.value = String(values.indexOf(T));
  show(T);
  await setT(T);
}
