// The page: the model's description, then one view at a time (each computed by the server on first
// open, as the command of the same name computes it).
import { api, fmt, h, message } from "./lib.js";
import { showBlock } from "./block.js";
import { showParams } from "./params.js";
import { showBus, showAblate } from "./stream.js";
import { showFrontier } from "./frontier.js";

const VIEWS = { block: showBlock, params: showParams, bus: showBus, ablate: showAblate, frontier: showFrontier };
const opened = new Set();

async function open(name, info) {
  for (const section of document.querySelectorAll("main > section")) section.hidden = section.dataset.view !== name;
  for (const tab of document.querySelectorAll("nav button")) tab.setAttribute("aria-pressed", String(tab.dataset.view === name));
  history.replaceState(null, "", `#${name}`);
  if (opened.has(name)) return;
  opened.add(name);
  try {
    await VIEWS[name](info);
  } catch (error) {
    opened.delete(name); // opening it again retries
    const text = `could not compute this view: ${error.message}`;
    document.getElementById(`view-${name}`).append(h("p", { class: "error", role: "alert" }, text));
  }
}

async function start() {
  const line = document.getElementById("model-line");
  const info = await api("/api/info");
  const c = info.config;
  line.textContent = `${info.model}: ${c.n_layer} blocks, width ${c.n_embd}, ${c.n_head} heads, context ${c.block_size}, ` +
    `vocabulary ${fmt(c.vocab_size)}, ${c.norm}-LN; ${fmt(info.params)} parameters` +
    (info.text ? `; text: ${info.text}` : "; text: held-out standard-library source");
  for (const tab of document.querySelectorAll("nav button")) tab.addEventListener("click", () => open(tab.dataset.view, info));
  const wanted = location.hash.slice(1);
  await open(wanted in VIEWS ? wanted : "block", info);
  document.body.dataset.ready = "true"; // the first view is drawn (the browser test waits for it)
}

start().catch((error) => message(document.getElementById("model-line"), `could not load: ${error.message}`, "error"));
