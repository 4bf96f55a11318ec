// The bus (blocklab bus) and ablation (blocklab ablate): both read the model on your text.
import { api, chart, commandLine, fill, fmt, focusable, h, legend, line, message, rule, s, signedPct, table } from "./lib.js";

let busData = null;
const bus = () => (busData ||= api("/api/bus").catch((error) => {
  busData = null; // a failed computation is asked for again next time
  throw error;
}));

const blockAxis = (rows) => ({ type: "band", domain: rows.map((r) => r.block), label: "block" });

function normsChart(report) {
  const rows = report.rows;
  const values = [report.embed, ...rows.flatMap((r) => [r.resid_pre, r.resid_post, r.attn_out, r.mlp_out])];
  const c = chart({
    x: blockAxis(rows),
    y: { type: "log", domain: [Math.min(...values) / 1.3, Math.max(...values) * 1.3], label: "median norm" },
    title: "the stream grows; what each stage writes",
  });
  c.svg.append(rule(c, report.embed, "rule embed", `‖embed‖ ${fmt(report.embed)}`));
  for (const [key, cls] of [["resid_pre", "stream"], ["resid_post", "stream-out"], ["attn_out", "attention"], ["mlp_out", "ff"]]) {
    c.svg.append(line(c, rows.map((r) => [r.block, r[key]]), `series ${cls}`));
  }
  return [c.svg, legend([["stream", "‖resid_pre‖ (entering)"], ["stream-out", "‖resid_post‖ (leaving)"],
    ["attention", "‖attn_out‖"], ["ff", "‖mlp_out‖"], ["embed", "‖embed‖"]])];
}

function sharesChart(report) {
  const rows = report.rows;
  const high = Math.max(1, ...rows.flatMap((r) => [r.attn_share, r.mlp_share]));
  const low = Math.min(0, ...rows.map((r) => r.cosine_in_out));
  const c = chart({ x: blockAxis(rows), y: { type: "linear", domain: [low, high * 1.05], label: "ratio" },
    title: "each write as a share of the stream it reads; cosine in and out" });
  const w = c.x.bandwidth * 0.36;
  for (const r of rows) {
    for (const [key, cls, dx] of [["attn_share", "attention", -w], ["mlp_share", "ff", 0]]) {
      const top = c.y(Math.max(0, r[key]));
      c.svg.append(s("rect", { class: `bar ${cls}`, x: c.x(r.block) + dx, y: top, width: w, height: Math.abs(c.y(0) - c.y(r[key])) }));
    }
  }
  c.svg.append(line(c, rows.map((r) => [r.block, r.cosine_in_out]), "series cosine"));
  return [c.svg, legend([["attention", "‖attn_out‖ / ‖resid_pre‖"], ["ff", "‖mlp_out‖ / ‖resid_mid‖"], ["cosine", "cos(resid_pre, resid_post)"]])];
}

export async function showBus() {
  const body = document.getElementById("bus-body");
  message(body, "running the model on the text (blocklab bus)…");
  const data = await bus();
  const report = data.report;
  const columns = ["block", "‖resid_pre‖", "‖attn_out‖/‖resid_pre‖", "‖mlp_out‖/‖resid_mid‖", "‖resid_post‖", "cos(pre, post)", "bookkeeping"];
  const keys = ["block", "resid_pre", "attn_share", "mlp_share", "resid_post", "cosine_in_out", "bookkeeping"];
  fill(body,
    h("p", {}, `text: ${report.text}; medians over positions; the embedding's norm ‖embed‖ = `,
      h("strong", { "data-key": "embed" }, fmt(report.embed))),
    h("div", { class: "charts" }, h("figure", {}, ...normsChart(report)), h("figure", {}, ...sharesChart(report))),
    table(columns, report.rows.map((r) => keys.map((k) => fmt(r[k]))), { id: "bus-table" }),
    h("p", { class: "note" }, report.norm === "pre" || report.norm === "peri"
      ? "bookkeeping: the largest over positions of ‖resid_post - (resid_pre + attn_out + mlp_out)‖ / ‖resid_post‖"
      : "bookkeeping: - (post-LN and DeepNorm normalise each sum: the stream is not the writes' sum)"),
    commandLine(data.command));
}

function blockDetail(loss, stream, block) {
  const r = loss.rows[block];
  const b = stream.rows[block];
  const norms = [["‖embed‖", stream.embed, "embed"], ["‖resid_pre‖", b.resid_pre, "resid_pre"], ["‖attn_out‖", b.attn_out, "attn_out"],
    ["‖mlp_out‖", b.mlp_out, "mlp_out"], ["‖resid_post‖", b.resid_post, "resid_post"]];
  const top = Math.max(...norms.map(([, v]) => v));
  return [
    h("h3", {}, `block ${block}`),
    h("dl", { class: "facts" },
      loss.modes.map((m) => [h("dt", {}, `${m} loss`), h("dd", { "data-key": m }, `${fmt(r[m])} (${signedPct(r[`${m}_change`])})`)])),
    h("p", { class: "note" }, "its norms (medians over positions, from blocklab bus):"),
    h("div", { class: "norm-bars" }, norms.map(([name, value, key]) => {
      const bar = h("span", { class: `fill ${key}` });
      bar.style.width = `${(100 * value) / top}%`;
      return h("div", { class: "norm-bar" }, h("span", { class: "name" }, name), h("span", { class: "track" }, bar),
        h("span", { class: "value", "data-key": key }, fmt(value)));
    })),
  ];
}

function lossChart(report, mode, selected, onSelect) {
  const rows = report.rows;
  const top = Math.max(report.uniform, ...rows.map((r) => r[mode])) * 1.08;
  const c = chart({ x: blockAxis(rows), y: { type: "linear", domain: [0, top], label: "mean next-token loss (nats)" },
    title: `loss with block i ${mode === "skip" ? "skipped" : "overwriting the stream"}` });
  const w = c.x.bandwidth * 0.7;
  for (const r of rows) {
    const mark = s("g", { class: `bar-mark${r.block === selected ? " selected" : ""}`, "data-block": r.block },
      s("rect", { class: `bar ${mode}`, x: c.x(r.block) - w / 2, y: c.y(r[mode]), width: w, height: c.y(0) - c.y(r[mode]) }));
    c.svg.append(focusable(mark, `block ${r.block}: ${mode} loss ${fmt(r[mode])}`, () => onSelect(r.block)));
  }
  c.svg.append(rule(c, report.intact, "rule intact", `intact ${fmt(report.intact)}`, "left"));
  c.svg.append(rule(c, report.uniform, "rule uniform", `uniform guess ln(V) ${fmt(report.uniform)}`));
  return c.svg;
}

export async function showAblate() {
  const body = document.getElementById("ablate-body");
  message(body, "scoring the text with each block removed, both ways (blocklab ablate)…");
  const [data, stream] = await Promise.all([api("/api/ablate"), bus()]);
  const report = data.report;
  let selected = 0;
  const mode = () => document.querySelector("input[name=ablate-mode]:checked").value;
  const figure = h("figure", {});
  const detail = h("div", { id: "block-norms", "aria-live": "polite" });
  const summary = h("p", {});
  function draw() {
    const m = mode();
    fill(figure, lossChart(report, m, selected, (block) => {
      selected = block;
      draw();
      figure.querySelector(`[data-block="${block}"]`).focus();
    }));
    fill(detail, ...blockDetail(report, stream.report, selected));
    const worst = report.rows.reduce((a, r) => (r[m] > a[m] ? r : a));
    const mildest = report.rows.reduce((a, r) => (r[m] < a[m] ? r : a));
    summary.textContent = `${m}: block ${worst.block} costs the most (${fmt(worst[m])}, ${signedPct(worst[`${m}_change`])}), ` +
      `block ${mildest.block} the least (${fmt(mildest[m])}, ${signedPct(mildest[`${m}_change`])})`;
    document.getElementById("view-ablate").dataset.mode = m;
  }
  for (const radio of document.querySelectorAll("input[name=ablate-mode]")) radio.addEventListener("change", draw);
  draw();
  fill(body,
    h("p", {}, `text: ${report.text}; intact loss `, h("strong", { "data-key": "intact" }, fmt(report.intact)),
      " nats; uniform guess ln(V) = ", h("strong", { "data-key": "uniform" }, fmt(report.uniform)),
      `; relative change = (loss - intact) / intact`),
    h("div", { class: "charts" }, figure, detail), summary, commandLine(data.command));
}
