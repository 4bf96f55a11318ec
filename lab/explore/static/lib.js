// What every view shares: building DOM and SVG, the server's JSON, numbers as the CLI prints them,
// and a small chart (scales, axes, a focusable mark). No library: the page must work offline.

const SVG_NS = "http://www.w3.org/2000/svg"; // a namespace name, never fetched

function build(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined && child !== false) {
      node.append(child instanceof Node ? child : String(child));
    }
  }
  return node;
}

export const h = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);
export const s = (tag, attrs, ...children) => build(document.createElementNS(SVG_NS, tag), attrs, children);

/** Replace ``node``'s children, with ``h``'s rules (arrays flattened, null and false left out). */
export function fill(node, ...children) {
  node.replaceChildren();
  return build(node, {}, children);
}

// --- the server -----------------------------------------------------------------------------------

const KEY_ITEM = "blocklab-explore-key";
let waitingForKey = null;

function takeKeyFromAddress() {
  // #key=KEY: a fragment never reaches a server or a log; drop it from the address bar at once
  if (location.hash.startsWith("#key=")) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(location.hash.slice(5)));
    history.replaceState(null, "", location.pathname + location.search);
  }
}
takeKeyFromAddress();

function askForKey() {
  if (waitingForKey) return waitingForKey;
  const form = document.getElementById("key-form");
  form.hidden = false;
  document.getElementById("api-key").focus();
  waitingForKey = new Promise((resolve) => {
    form.addEventListener("submit", function submitted(event) {
      event.preventDefault();
      sessionStorage.setItem(KEY_ITEM, document.getElementById("api-key").value);
      form.hidden = true;
      form.removeEventListener("submit", submitted);
      waitingForKey = null;
      resolve();
    });
  });
  return waitingForKey;
}

/** GET a JSON endpoint of the server that served the page; asks for the API key on a 401. */
export async function api(path) {
  const key = sessionStorage.getItem(KEY_ITEM);
  const response = await fetch(path, { headers: key ? { "X-API-Key": key } : {} });
  if (response.status === 401) {
    await askForKey();
    return api(path);
  }
  const body = await response.json();
  if (!response.ok) {
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    throw new Error(`${response.status}: ${detail}`);
  }
  return body;
}

// --- numbers as the CLI's tables print them (lab.analysis.common.fmt) -------------------------------

const wholeNumber = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0, roundingMode: "halfEven" });

/** Integers with thousands separators; floats to 4 significant figures, thousands and up as whole
 * numbers with separators, the very large or very small in scientific notation. */
export function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "-";
  if (typeof value === "boolean") return String(value);
  if (typeof value !== "number") return String(value);
  if (!Number.isFinite(value)) return String(value);
  // JSON does not tell 2 from 2.0; the two print alike below 1e15, where every count here lies
  if (Number.isInteger(value) && Math.abs(value) < 1e15) return wholeNumber.format(value);
  if (value !== 0 && (Math.abs(value) >= 1e15 || Math.abs(value) < 1e-3)) {
    return value.toExponential(digits - 1).replace(/e([+-])(\d)$/, "e$10$2"); // Python's e-05
  }
  if (Math.abs(value) >= 10 ** (digits - 1)) return wholeNumber.format(value);
  let text = value.toPrecision(digits);
  if (text.includes(".")) text = text.replace(/0+$/, "").replace(/\.$/, "");
  return text;
}

/** A float as the CLI's text prints one with ``{:,.0f}`` (the crossover lengths). */
export const whole = (value) => wholeNumber.format(value);

/** A share as the CLI prints it: 100 x, ``decimals`` after the point, a percent sign. */
export const pct = (share, decimals = 1) => `${(100 * share).toFixed(decimals)}%`;
export const signedPct = (share, decimals = 1) => `${share >= 0 ? "+" : ""}${pct(share, decimals)}`;

/** A "command that prints the same JSON" line. */
export const commandLine = (...commands) =>
  h("p", { class: "command" }, "the same numbers: ", ...commands.map((c) => h("code", {}, c)));

export function message(container, text, kind = "note") {
  fill(container, h("p", { class: kind, role: kind === "error" ? "alert" : "status" }, text));
}

// --- charts ------------------------------------------------------------------------------------------

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((step) => step >= raw);
}

/** A linear or log scale from ``domain`` to ``range``, with ``ticks()``. */
export function scale(type, [d0, d1], [r0, r1]) {
  const f = type === "log" ? Math.log10 : (v) => v;
  const [f0, f1] = [f(d0), f(d1)];
  const map = (v) => r0 + ((f(v) - f0) / (f1 - f0 || 1)) * (r1 - r0);
  map.ticks = (count = 5) => {
    if (type === "log") {
      const out = [];
      for (let k = Math.floor(f0); k <= Math.ceil(f1); k++) if (10 ** k >= d0 && 10 ** k <= d1) out.push(10 ** k);
      return out.length >= 2 ? out : [d0, d1];
    }
    const step = niceStep(d1 - d0, count);
    const out = [];
    for (let v = Math.ceil(d0 / step) * step; v <= d1 + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  };
  return map;
}

/** An SVG with a plot area and labelled axes: ``x``/``y`` are {type, domain, label, ticks?}; a band
 * x axis ({type: "band", domain: [names]}) places one slot per name (``x(name)`` is its centre). */
export function chart({ width = 560, height = 260, x, y, title, left = 64 }) {
  const margin = { top: title ? 26 : 10, right: 14, bottom: 42, left };
  const plotRight = width - margin.right;
  const plotBottom = height - margin.bottom;
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img", "aria-label": title || y.label });
  let xs;
  if (x.type === "band") {
    const slot = (plotRight - margin.left) / x.domain.length;
    xs = (name) => margin.left + slot * (x.domain.indexOf(name) + 0.5);
    xs.bandwidth = slot;
  } else {
    xs = scale(x.type, x.domain, [margin.left, plotRight]);
  }
  const ys = scale(y.type, y.domain, [plotBottom, margin.top]);
  const axis = s("g", { class: "axis" });
  axis.append(s("line", { x1: margin.left, x2: plotRight, y1: plotBottom, y2: plotBottom }));
  axis.append(s("line", { x1: margin.left, x2: margin.left, y1: margin.top, y2: plotBottom }));
  const xTicks = x.type === "band" ? x.domain : x.ticks || xs.ticks(6);
  for (const t of xTicks) {
    axis.append(s("text", { x: xs(t), y: plotBottom + 14, "text-anchor": "middle" }, x.tickFormat ? x.tickFormat(t) : fmt(t)));
  }
  for (const t of y.ticks || ys.ticks(5)) {
    axis.append(s("line", { class: "grid", x1: margin.left, x2: plotRight, y1: ys(t), y2: ys(t) }));
    axis.append(s("text", { x: margin.left - 6, y: ys(t) + 4, "text-anchor": "end" }, y.tickFormat ? y.tickFormat(t) : fmt(t)));
  }
  axis.append(s("text", { x: (margin.left + plotRight) / 2, y: height - 6, "text-anchor": "middle", class: "label" }, x.label));
  axis.append(s("text", { x: 12, y: (margin.top + plotBottom) / 2, transform: `rotate(-90 12 ${(margin.top + plotBottom) / 2})`, "text-anchor": "middle", class: "label" }, y.label));
  if (title) axis.append(s("text", { x: margin.left, y: 16, class: "title" }, title));
  svg.append(axis);
  return { svg, x: xs, y: ys, left: margin.left, right: plotRight, top: margin.top, bottom: plotBottom };
}

/** A polyline through ``points`` ([x, y] in data units) with a dot at each. */
export function line(c, points, cls) {
  const d = points.map(([px, py], i) => `${i ? "L" : "M"}${c.x(px).toFixed(1)},${c.y(py).toFixed(1)}`).join("");
  return s("g", { class: cls }, s("path", { d }), points.map(([px, py]) => s("circle", { cx: c.x(px), cy: c.y(py), r: 3 })));
}

/** A horizontal reference line across the plot at ``value``, labelled above it at its right end
 * (``at: "left"``: its left end, for a second line close to the first). */
export function rule(c, value, cls, label, at = "right") {
  const x = at === "right" ? c.right - 4 : c.left + 4;
  return s("g", { class: cls },
    s("line", { x1: c.left, x2: c.right, y1: c.y(value), y2: c.y(value) }),
    s("text", { x, y: c.y(value) - 4, "text-anchor": at === "right" ? "end" : "start" }, label));
}

/** Make an SVG mark a button: focusable by Tab, named for screen readers, Enter or Space clicks it. */
export function focusable(node, label, onSelect) {
  node.setAttribute("tabindex", "0");
  node.setAttribute("role", "button");
  node.setAttribute("aria-label", label);
  node.addEventListener("click", onSelect);
  node.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      onSelect();
    }
  });
  return node;
}

export function legend(entries) {
  return h("ul", { class: "legend" }, entries.map(([cls, text]) => h("li", {}, h("span", { class: `swatch ${cls}` }), text)));
}

/** A table: ``columns`` names, ``rows`` arrays of cells (strings or nodes). */
export function table(columns, rows, attrs = {}) {
  return h("table", attrs,
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((cells) => h("tr", {}, cells.map((cell) => h("td", {}, cell))))));
}
