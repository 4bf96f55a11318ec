// Depth (blocklab depth: measured here or loaded) and the latency/loss frontier of a traffic or plan JSON.
import { api, chart, commandLine, fill, fmt, h, legend, message, s, table } from "./lib.js";

// --- depth -----------------------------------------------------------------------------------------

function depthChart(report) {
  const rows = report.rows;
  const top = Math.max(...rows.map((r) => r.blocks_ms + r.unembed_ms)) * 1.15;
  const c = chart({ x: { type: "band", domain: rows.map((r) => r.stack), label: "stack (L x d)" },
    y: { type: "linear", domain: [0, top], label: "ms per decoded token (median)" },
    title: `batch-1 decode, ratios to ${report.baseline}` });
  const w = c.x.bandwidth * 0.6;
  for (const r of rows) {
    const x = c.x(r.stack) - w / 2;
    c.svg.append(s("rect", { class: "bar blocks", x, y: c.y(r.blocks_ms), width: w, height: c.y(0) - c.y(r.blocks_ms) }));
    c.svg.append(s("rect", { class: "bar unembed", x, y: c.y(r.blocks_ms + r.unembed_ms), width: w, height: c.y(0) - c.y(r.unembed_ms) }));
    c.svg.append(s("text", { x: c.x(r.stack), y: c.y(r.blocks_ms + r.unembed_ms) - 4, "text-anchor": "middle" }, `${r.ratio.toFixed(2)}x`));
  }
  return [c.svg, legend([["linear", "Blocks (embedding lookup included)"], ["unembedding", "unembedding (ln_f + V x d)"]])];
}

function drawDepth(report, command) {
  const columns = ["stack", "heads x size", "block params", "ms/token", "Blocks ms", "unembed ms", `/ ${report.baseline}`, `Blocks / ${report.baseline}`];
  const rows = report.rows.map((r) => [r.stack, `${r.n_head} x ${r.head_size}`, fmt(r.block_params), fmt(r.ms_per_token),
    fmt(r.blocks_ms), fmt(r.unembed_ms), `${r.ratio.toFixed(2)}x`, `${r.blocks_ratio.toFixed(2)}x`]);
  const [before, after] = report.load_average || [null, null];
  fill(document.getElementById("depth-body"),
    h("p", {}, `batch-1 decode with a KV cache, prompt ${report.prompt} tokens, ${report.new_tokens} new; median over ` +
      `${report.samples_per_stack} decode steps (${report.repeats} repeats), ${report.threads} threads, V=${fmt(report.vocab_size)}, ` +
      `random weights; load average ${fmt(before)} at start, ${fmt(after)} at end`),
    h("figure", {}, ...depthChart(report)),
    table(columns, rows, { id: "depth-table" }),
    command ? commandLine(command) : h("p", { class: "note" }, "loaded from a file"));
}

// --- the frontier ------------------------------------------------------------------------------------

const interval = (ci) => (Array.isArray(ci) && ci.length === 2 ? ci : null);

/** The points nothing faster beats on loss, fastest first (the rule of blocklab traffic and plan). */
function frontierOf(points) {
  let best = Infinity;
  const kept = new Set();
  for (const p of [...points].sort((a, b) => a.x - b.x || a.y - b.y)) {
    if (p.y < best) {
      kept.add(p.label);
      best = p.y;
    }
  }
  return kept;
}

function trafficPoints(json, rate) {
  return json.block_sets.filter((r) => r.request_rate === rate && r.median_e2el_ms !== null && r.mean_loss !== null)
    .map((r) => ({ label: r.block_set, x: r.median_e2el_ms, y: r.mean_loss, xci: interval(r.median_e2el_ms_ci), yci: interval(r.mean_loss_ci) }));
}

function planPoints(json) {
  const seen = new Map();
  for (const p of [json.all, ...Object.values(json.methods).flat()]) {
    if (p.ms_per_token !== null && !seen.has(p.block_set)) {
      seen.set(p.block_set, { label: p.block_set, x: p.ms_per_token, y: p.loss, xci: interval(p.ms_per_token_ci), yci: interval(p.loss_ci) });
    }
  }
  return [...seen.values()];
}

function errorBar(c, [x0, y0, x1, y1], vertical) {
  const cap = 4;
  const ends = vertical
    ? [[x0 - cap, y0, x0 + cap, y0], [x1 - cap, y1, x1 + cap, y1]]
    : [[x0, y0 - cap, x0, y0 + cap], [x1, y1 - cap, x1, y1 + cap]];
  return s("g", { class: "error-bar" }, s("line", { x1: x0, y1: y0, x2: x1, y2: y1 }),
    ends.map(([a, b, cc, d]) => s("line", { x1: a, y1: b, x2: cc, y2: d })));
}

function frontierChart(points, onFrontier, xLabel) {
  const xs = points.flatMap((p) => [p.x, ...(p.xci || [])]);
  const ys = points.flatMap((p) => [p.y, ...(p.yci || [])]);
  const pad = (lo, hi) => [lo - 0.08 * (hi - lo || Math.abs(hi) || 1), hi + 0.08 * (hi - lo || Math.abs(hi) || 1)];
  const c = chart({ width: 640, height: 320, x: { type: "linear", domain: pad(Math.min(...xs), Math.max(...xs)), label: xLabel },
    y: { type: "linear", domain: pad(Math.min(...ys), Math.max(...ys)), label: "loss (nats)" }, title: "latency against loss; the frontier joined" });
  const front = points.filter((p) => onFrontier.has(p.label)).sort((a, b) => a.x - b.x);
  c.svg.append(s("path", { class: "frontier-line", d: front.map((p, i) => `${i ? "L" : "M"}${c.x(p.x)},${c.y(p.y)}`).join("") }));
  for (const p of points) {
    if (p.xci) c.svg.append(errorBar(c, [c.x(p.xci[0]), c.y(p.y), c.x(p.xci[1]), c.y(p.y)], false));
    if (p.yci) c.svg.append(errorBar(c, [c.x(p.x), c.y(p.yci[0]), c.x(p.x), c.y(p.yci[1])], true));
    c.svg.append(s("circle", { class: onFrontier.has(p.label) ? "point on" : "point", cx: c.x(p.x), cy: c.y(p.y), r: 4 }));
    c.svg.append(s("text", { class: "point-label", x: c.x(p.x) + 6, y: c.y(p.y) - 6 }, p.label));
  }
  return c.svg;
}

function drawFrontier(name, points, onFrontier, xLabel, extra) {
  const ci = (v) => (v ? `[${fmt(v[0])}, ${fmt(v[1])}]` : "-");
  const rows = [...points].sort((a, b) => a.x - b.x).map((p) => [p.label, fmt(p.x), ci(p.xci), fmt(p.y), ci(p.yci), onFrontier.has(p.label) ? "yes" : "no"]);
  const hasIntervals = points.some((p) => p.xci || p.yci);
  fill(document.getElementById("frontier-body"),
    h("p", {}, `from ${name}`), extra,
    h("figure", {}, frontierChart(points, onFrontier, xLabel),
      legend([["attention", "on the frontier: no faster set has a lower loss"], ["norm", "beaten"]])),
    hasIntervals ? h("p", { class: "note" }, "bars: the intervals the file gives (low, high)") : h("p", { class: "note" }, "no intervals in this file"),
    table(["block set", xLabel, "interval", "loss", "interval", "on the frontier"], rows, { id: "frontier-table" }));
}

function showTraffic(json, name) {
  const rates = [...new Set(json.block_sets.map((r) => r.request_rate))];
  const draw = (rate) => {
    const points = trafficPoints(json, rate);
    let picker = null;
    if (rates.length > 1) {
      const select = h("select", { id: "rate-select", onchange: (e) => draw(rates[+e.target.value]) },
        rates.map((r, i) => h("option", { value: i, selected: r === rate }, r === null ? "closed loop" : `${r} req/s`)));
      picker = h("p", {}, h("label", { for: "rate-select" }, "request rate "), select);
    }
    drawFrontier(name, points, frontierOf(points), "median end-to-end latency (ms)", picker);
  };
  draw(rates[0]);
}

function load(json, name) {
  if (Array.isArray(json.rows) && json.rows.length && "ms_per_token" in json.rows[0] && "stack" in json.rows[0]) {
    drawDepth(json, null);
  } else if (json.frontier && json.methods && json.all) {
    drawFrontier(name, planPoints(json), new Set(json.frontier.map((p) => p.block_set)), "decode ms per token");
  } else if (Array.isArray(json.block_sets) && json.block_sets.length && "median_e2el_ms" in json.block_sets[0]) {
    showTraffic(json, name);
  } else {
    throw new Error("not a JSON written by blocklab depth, traffic or plan");
  }
}

async function readFile(file) {
  const target = document.getElementById("frontier-body");
  try {
    load(JSON.parse(await file.text()), file.name);
  } catch (error) {
    message(target, `${file.name}: ${error.message}`, "error");
  }
}

export async function showFrontier(info) {
  const d = info.depth_defaults;
  const form = document.getElementById("depth-form");
  const fields = { stacks: d.stacks.join(" "), baseline: d.baseline, new: d.new, repeats: d.repeats };
  for (const [name, value] of Object.entries(fields)) document.getElementById(`depth-${name}`).value = String(value);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const stacks = document.getElementById("depth-stacks").value.trim().split(/[\s,]+/);
    const query = new URLSearchParams(stacks.map((stack) => ["stacks", stack]));
    for (const name of ["baseline", "new", "repeats"]) query.append(name, document.getElementById(`depth-${name}`).value);
    message(document.getElementById("depth-body"), "building and timing each stack (blocklab depth)…");
    try {
      const data = await api(`/api/depth?${query}`);
      drawDepth(data.report, data.command);
    } catch (error) {
      message(document.getElementById("depth-body"), `depth: ${error.message}`, "error");
    }
  });
  document.getElementById("json-file").addEventListener("change", (event) => event.target.files[0] && readFile(event.target.files[0]));
  const zone = document.getElementById("view-frontier");
  zone.addEventListener("dragover", (event) => event.preventDefault());
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    if (event.dataTransfer.files[0]) readFile(event.dataTransfer.files[0]);
  });
  message(document.getElementById("frontier-body"), "No frontier yet: load the traffic.json of blocklab traffic or the plan.json of blocklab plan.");
}
