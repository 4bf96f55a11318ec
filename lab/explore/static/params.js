// Parameters by component (blocklab params --all, and --model for the model being explored).
import { api, commandLine, fill, fmt, h, legend, pct, table } from "./lib.js";

function kind(component) {
  if (component.startsWith("attention")) return "attention";
  if (component.startsWith("feed-forward")) return "ff";
  if (component.endsWith("blocks")) return "blocks";
  if (component === "token table") return "token";
  if (component === "position table") return "position";
  if (component.startsWith("output head")) return "head";
  return "norm";
}

function stacked(rows, label) {
  const bar = h("div", { class: "stacked", role: "img", "aria-label": label });
  for (const row of rows) {
    const part = h("span", { class: `part ${kind(row.component)}`, title: `${row.component}: ${pct(row.share, 2)}` },
      row.share > 0.12 ? `${row.component.split(" (")[0]} ${pct(row.share)}` : "");
    part.style.width = `${100 * row.share}%`;
    bar.append(part);
  }
  return bar;
}

function designRow(report, isSelected, isYours, onSelect) {
  const blockRows = report.block.filter((r) => r.component !== "block");
  return h("div", { class: "design" },
    h("button", { type: "button", class: "design-name", "aria-pressed": String(isSelected), "data-design": report.design, onclick: onSelect },
      h("span", {}, report.design, isYours ? h("span", { class: "yours" }, " (the model explored)") : null),
      h("span", { class: "total" }, `${fmt(report.total)} parameters`)),
    h("div", { class: "bars" },
      h("span", { class: "bar-label" }, "a block"), stacked(blockRows, `${report.design}: a block's parameters`),
      h("span", { class: "bar-label" }, "the model"), stacked(report.model, `${report.design}: the model's parameters`)));
}

function designTable(report) {
  const lines = (rows) => rows.map((r) => [r.component, h("code", {}, r.formula), fmt(r.params), fmt(r.counted), pct(r.share, 2)]);
  const s = report.shape;
  return [
    h("h3", {}, `${report.design}: d = ${s.d}, L = ${s.L}, heads ${s.n_head} (kv ${s.n_kv_head}), d_ff = ${fmt(s.d_ff)}, ` +
      `V = ${fmt(s.V)}, T = ${fmt(s.T)}`),
    report.source ? h("p", { class: "note" }, `source: ${report.source}`) : null,
    h("p", {},
      "feed-forward ", h("strong", { "data-key": "feed_forward_share_of_block" }, pct(report.feed_forward_share_of_block)),
      " of a block, attention ", h("strong", { "data-key": "attention_share_of_block" }, pct(report.attention_share_of_block)),
      "; the token table ", h("strong", { "data-key": "token_table_share" }, pct(report.token_table_share)),
      " of all parameters; output head ", report.tied_head ? "tied to the token table" : "untied (its own V × d matrix)",
      "; non-embedding parameters ", h("strong", { "data-key": "non_embedding" }, fmt(report.non_embedding)), "."),
    table(["per block", "formula", "params", "counted", "share of the block"], lines(report.block)),
    table(["model", "formula", "params", "counted", "share of all"],
      [...lines(report.model), ["total", "", h("span", { "data-key": "total" }, fmt(report.total)), fmt(report.total_counted), "100%"]]),
  ];
}

export async function showParams() {
  const body = document.getElementById("params-body");
  const data = await api("/api/params");
  const reports = [data.model, ...data.designs];
  let selected = 0; // by place: the model explored may share a preset's name (--model gpt2)
  const detail = h("div", { id: "design-detail", "aria-live": "polite" });
  const list = h("div", { class: "designs" });
  function draw() {
    fill(list, ...reports.map((r, i) => designRow(r, i === selected, i === 0, () => {
      selected = i;
      draw();
    })));
    fill(detail, ...designTable(reports[selected]));
  }
  draw();
  fill(body,
    legend([["attention", "attention"], ["ff", "feed-forward"], ["norm", "norms"], ["blocks", "the blocks"],
      ["token", "token table"], ["position", "position table"], ["head", "untied output head"]]),
    list, detail, commandLine(data.commands.model, data.commands.designs));
}
