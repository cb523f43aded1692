"""One self-contained interactive HTML page of captured attention (inline CSS and JS, no network).

Choose a layer and a head (or click a thumbnail in the layers × heads overview); hover a token to
see where it attends (lines to the keys and its heatmap row light up), click it to pin. The named
shapes of the call are shown above the views. Needs no matplotlib.
"""

from __future__ import annotations

import html as _html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..text import named_shape

if TYPE_CHECKING:
    from ..inspect.capture import Capture


def page_data(cap: Capture, tokens: Sequence[str] | None = None, *, key_tokens: Sequence[str] | None = None,
              b: int = 0, special: Iterable[str] = ("[CLS]", "[SEP]"), digits: int = 4) -> dict:
    """What the page shows, as plain JSON-able data: tokens, and per layer its named shapes, its
    captured heads, their weights [r][K] (rounded) and head statistics."""
    from ..inspect.stats import head_stats

    if not cap.records:
        raise ValueError("html: the capture holds no records; run the model inside `with capture(...)`.")
    if any(r.weights is None for r in cap.records):
        raise ValueError("html: the page needs the weights; capture with what=(..., 'weights').")
    keys = key_tokens if key_tokens is not None else tokens
    special = tuple(special)
    stats = head_stats(cap, keys, b=b, special=special) if keys is not None and _same_k(cap, keys) else head_stats(cap, None, b=b)
    by = {(s.index, s.head): s for s in stats}
    layers = []
    for rec in cap.records:
        s = rec.sizes
        Q, K = s["Q"], s["K"]
        shapes = [
            ("q", named_shape(("B", "H", "Q", "d"), (s["B"], s["H"], Q, s["d"]))),
            ("k", named_shape(("B", "Hkv", "K", "d"), (s["B"], s["Hkv"], K, s["d"]))),
            ("v", named_shape(("B", "Hkv", "K", "dv"), (s["B"], s["Hkv"], K, s["dv"]))),
            ("S, P", named_shape(("B", "H", "Q", "K"), (s["B"], s["H"], Q, K))),
            ("out", named_shape(("B", "H", "Q", "dv"), (s["B"], s["H"], Q, s["dv"]))),
        ]
        W = rec.weights[b].float().cpu()  # [h, r, K]
        heads = []
        for i, h in enumerate(rec.heads):
            st = by[(rec.index, h)]
            heads.append({
                "head": h,
                "w": [[round(float(x), digits) for x in row] for row in W[i].tolist()],
                "stats": {"entropy": round(st.entropy, 3), "distance": round(st.distance, 2), "first": round(st.first, 3),
                          **{f"on {t}": round(v, 3) for t, v in st.special.items()}},
            })
        layers.append({"index": rec.index, "name": rec.name, "backend": rec.backend, "shapes": shapes,
                       "rows": rec.query_positions, "K": K, "mask": repr(rec.mask) if rec.mask is not None else "none",
                       "heads": heads})
    Kmax = max(la["K"] for la in layers)
    Qmax = max(la["rows"][-1] + 1 if la["rows"] else 0 for la in layers)
    qt = list(tokens) if tokens is not None else [str(i) for i in range(Qmax)]
    kt = list(keys) if keys is not None else [str(i) for i in range(Kmax)]
    return {"tokens": qt, "keyTokens": kt, "b": b, "layers": layers}


def _same_k(cap: Capture, keys: Sequence[str]) -> bool:
    return all(r.sizes["K"] == len(keys) for r in cap.records)


def render(data: dict, title: str = "bhqk · attention") -> str:
    """The page as one HTML string."""
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return (_TEMPLATE.replace("__TITLE__", _html.escape(title)).replace("__CSS__", _CSS).replace("__JS__", _JS)
            .replace("__DATA__", blob))


def html(cap: Capture, tokens: Sequence[str] | None = None, path: str | Path = "attention.html", *,
         key_tokens: Sequence[str] | None = None, b: int = 0, layer: int | str | None = None, head: int | None = None,
         title: str | None = None, special: Iterable[str] = ("[CLS]", "[SEP]")) -> Path:
    """Write the interactive page for ``cap`` (one token per query; ``key_tokens`` for cross-attention)
    to ``path`` and return the path; it opens on ``layer`` (call index or name) and ``head``. The file
    works offline in any current browser."""
    data = page_data(cap, tokens, key_tokens=key_tokens, b=b, special=special)
    li = 0 if layer is None else cap.records.index(cap[layer])
    heads = cap.records[li].heads
    if head is not None and head not in heads:
        raise ValueError(f"html: head {head} was not captured for {cap.records[li].name!r}; captured heads: {heads}.")
    data["start"] = [li, 0 if head is None else heads.index(head)]
    if title is None:
        title = "bhqk · attention" + (f" · {' '.join(tokens)}" if tokens is not None else "")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data, title), encoding="utf-8")
    return out


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>__TITLE__</title>
<style>__CSS__</style>
</head>
<body>
<header>
  <h1>Attention, <span class="dim">rows = queries, columns = keys</span></h1>
  <div id="controls">
    <label>layer <select id="layer" data-testid="layer"></select></label>
    <label>head <select id="head" data-testid="head"></select></label>
    <span class="dim">view</span>
    <span class="seg" id="views">
      <button data-view="both" class="on">both</button><button data-view="lines">lines</button><button data-view="heatmap">heatmap</button>
    </span>
    <span class="dim keys">keys: ←/→ head, ↑/↓ layer, Esc unpin</span>
  </div>
  <div id="shapes" data-testid="shapes"></div>
  <div id="info" data-testid="info">Hover a query token (left column or heatmap row) to see where it attends; click to pin.</div>
</header>
<main>
  <section id="lines-view" class="card"><h2>where each query attends</h2><svg id="lines" data-testid="lines"></svg></section>
  <section id="heatmap-view" class="card"><h2 id="heatmap-title">P[b, h]</h2><svg id="heatmap" data-testid="heatmap"></svg></section>
  <section id="overview-view" class="card"><h2>all layers × heads <span class="dim">(click one)</span></h2>
    <canvas id="overview" data-testid="overview"></canvas>
    <div id="stats" data-testid="stats"></div>
  </section>
</main>
<script id="data" type="application/json">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""

_CSS = """
:root { --fg:#1d2330; --dim:#6b7280; --line:#2c5aa0; --hl:#e4572e; --card:#ffffff; --bg:#f4f5f7; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color:var(--fg); background:var(--bg); }
header { padding:12px 20px 6px; }
h1 { font-size:18px; margin:0 0 8px; }
h2 { font-size:13px; font-weight:600; margin:0 0 6px; color:var(--dim); }
.dim { color:var(--dim); font-weight:400; }
#controls { display:flex; gap:14px; align-items:center; flex-wrap:wrap; }
select { font:inherit; padding:2px 6px; }
.seg button { font:inherit; border:1px solid #c5cad3; background:#fff; padding:2px 10px; cursor:pointer; }
.seg button + button { border-left:none; }
.seg button.on { background:var(--line); color:#fff; border-color:var(--line); }
.keys { font-size:12px; }
#shapes { margin-top:8px; font:12px/1.6 ui-monospace, "DejaVu Sans Mono", monospace; display:flex; flex-wrap:wrap; gap:4px 16px; }
#shapes b { color:var(--line); font-weight:600; }
main { display:flex; flex-wrap:wrap; gap:14px; padding:8px 20px; align-items:flex-start; }
.card { background:var(--card); border-radius:8px; box-shadow:0 1px 3px rgba(0,0,0,.12); padding:10px 12px; }
.hidden { display:none; }
svg text { font-size:13px; fill:var(--fg); cursor:default; user-select:none; }
svg text.tok { cursor:pointer; }
svg text.tok.focus { fill:var(--hl); font-weight:700; }
svg text.dimmed { fill:#b8bcc6; }
svg .keybg { fill:var(--line); }
svg line.w { stroke:var(--line); stroke-linecap:round; }
svg rect.cell { stroke:none; }
svg rect.cell.masked { fill:#e6e6e6; }
svg rect.rowbox { fill:none; stroke:var(--hl); stroke-width:2.5; pointer-events:none; }
svg rect.cell.hl { stroke:var(--hl); stroke-width:0; }
#overview { cursor:pointer; display:block; }
#stats { margin-top:8px; font-size:12px; color:var(--dim); }
#stats b { color:var(--fg); }
#info { margin-top:8px; padding:6px 10px; background:#fff; border-left:3px solid var(--hl); border-radius:4px; min-height:2.2em; }
#info b { color:var(--hl); }
"""

_JS = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const VIRIDIS = ["#440154","#472d7b","#3b528b","#2c728e","#21918c","#28ae80","#5ec962","#addc30","#fde725"];
const state = { layer: (D.start || [0, 0])[0], head: (D.start || [0, 0])[1], focus: null, pinned: false, view: "both" };

function hex(c) { return [1,3,5].map(i => parseInt(c.slice(i, i+2), 16)); }
const STOPS = VIRIDIS.map(hex);
function color(t) {
  t = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
  const i = Math.min(Math.floor(t), STOPS.length - 2), f = t - i;
  const c = STOPS[i].map((a, j) => Math.round(a + (STOPS[i+1][j] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function cur() { const L = D.layers[state.layer]; return { L, H: L.heads[state.head] }; }
function qtok(L, r) { const p = L.rows[r]; return D.tokens[p] !== undefined ? D.tokens[p] : String(p); }
function ktok(k) { return D.keyTokens[k] !== undefined ? D.keyTokens[k] : String(k); }
function measure(texts) {
  const svg = document.getElementById("lines");
  const t = el("text", { x: -1000, y: -1000 }, svg);
  let w = 0;
  for (const s of texts) { t.textContent = s; w = Math.max(w, t.getComputedTextLength()); }
  svg.removeChild(t);
  return Math.ceil(w);
}

function fillSelects() {
  const ls = document.getElementById("layer"), hs = document.getElementById("head");
  clear(ls);
  D.layers.forEach((L, i) => { const o = document.createElement("option"); o.value = i;
    o.textContent = `${L.index}` + (L.name.startsWith("attention.") ? "" : ` · ${L.name}`); ls.appendChild(o); });
  ls.value = state.layer;
  clear(hs);
  D.layers[state.layer].heads.forEach((H, i) => { const o = document.createElement("option"); o.value = i;
    o.textContent = H.head; hs.appendChild(o); });
  hs.value = state.head;
}

function drawShapes() {
  const { L, H } = cur(), box = document.getElementById("shapes");
  clear(box);
  for (const [name, shape] of L.shapes) {
    const s = document.createElement("span"); const b = document.createElement("b");
    b.textContent = name + " "; s.appendChild(b); s.appendChild(document.createTextNode(shape)); box.appendChild(s);
  }
  const extra = document.createElement("span");
  extra.textContent = `backend ${L.backend} · mask ${L.mask} · showing b=${D.b}, h=${H.head}: P[b, h] is [Q=${L.rows.length}, K=${L.K}]`;
  box.appendChild(extra);
  document.body.dataset.layer = L.index; document.body.dataset.head = H.head;
}

let LINES = null, CELLS = null, ROWBOX = null;

function drawLines() {
  const { L, H } = cur(), svg = document.getElementById("lines");
  clear(svg);
  const R = L.rows.length, K = L.K, rowH = 22, pad = 14;
  const qs = L.rows.map((_, r) => qtok(L, r)), ks = [...Array(K).keys()].map(ktok);
  const wq = measure(qs), wk = measure(ks), gap = 170;
  const xq = pad + wq, xk = xq + gap, width = xk + wk + pad + 6, height = Math.max(R, K) * rowH + 26;
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  el("text", { x: xq, y: 12, "text-anchor": "end", class: "dim", style: "font-size:11px;fill:#6b7280" }, svg, "query");
  el("text", { x: xk, y: 12, style: "font-size:11px;fill:#6b7280" }, svg, "key");
  const y = i => 30 + i * rowH;
  const gl = el("g", {}, svg), gk = el("g", {}, svg), gq = el("g", {}, svg);
  LINES = [];
  for (let r = 0; r < R; r++) {
    const row = [];
    for (let k = 0; k < K; k++) {
      const w = H.w[r][k];
      row.push(el("line", { class: "w", x1: xq + 6, y1: y(r) - 4, x2: xk - 6, y2: y(k) - 4, "data-w": w }, gl));
    }
    LINES.push(row);
  }
  L._keybg = ks.map((s, k) => el("rect", { class: "keybg", x: xk - 3, y: y(k) - 15, width: measure([s]) + 6, height: 19, rx: 3, opacity: 0 }, gk));
  L._ktext = ks.map((s, k) => el("text", { x: xk, y: y(k), "data-k": k }, gk, s));
  L._qtext = qs.map((s, r) => {
    const t = el("text", { class: "tok", x: xq, y: y(r), "text-anchor": "end", "data-q": r, "data-testid": `q-${r}` }, gq, s);
    t.addEventListener("mouseenter", () => hover(r));
    t.addEventListener("mouseleave", () => hover(null));
    t.addEventListener("click", () => pin(r));
    return t;
  });
}

function drawHeatmap() {
  const { L, H } = cur(), svg = document.getElementById("heatmap");
  clear(svg);
  const R = L.rows.length, K = L.K;
  const qs = L.rows.map((_, r) => qtok(L, r)), ks = [...Array(K).keys()].map(ktok);
  const c = Math.max(8, Math.min(36, Math.floor(420 / Math.max(R, K))));
  const left = measure(qs) + 12, top = Math.ceil(measure(ks) * 0.82) + 16;
  let vmax = 1e-6; for (const row of H.w) for (const w of row) vmax = Math.max(vmax, w);
  const legendW = 56;
  svg.setAttribute("width", left + K * c + legendW + 8); svg.setAttribute("height", top + R * c + 10);
  document.getElementById("heatmap-title").textContent =
    `P[b=${D.b}, h=${H.head}]: [Q=${R}, K=${K}], layer ${L.index}`;
  const g = el("g", { transform: `translate(${left},${top})` }, svg);
  CELLS = [];
  for (let r = 0; r < R; r++) {
    const row = [];
    const sum = H.w[r].reduce((a, b) => a + b, 0);
    for (let k = 0; k < K; k++) {
      const w = H.w[r][k];
      const rect = el("rect", { class: "cell", x: k * c, y: r * c, width: c - 1, height: c - 1, fill: color(w / vmax),
        "data-q": r, "data-k": k, "data-w": w }, g);
      if (sum === 0) rect.classList.add("masked");
      el("title", {}, rect, `query ${qs[r]} → key ${ks[k]}: ${w.toFixed(4)}`);
      rect.addEventListener("mouseenter", () => hover(r, k));
      rect.addEventListener("mouseleave", () => hover(null));
      rect.addEventListener("click", () => pin(r));
      row.push(rect);
    }
    CELLS.push(row);
    const t = el("text", { class: "tok", x: -6, y: r * c + c / 2 + 4, "text-anchor": "end", "data-q": r, "data-testid": `row-${r}` }, g, qs[r]);
    t.addEventListener("mouseenter", () => hover(r));
    t.addEventListener("mouseleave", () => hover(null));
    t.addEventListener("click", () => pin(r));
    L["_hq" + r] = t;
  }
  ks.forEach((s, k) => el("text", { x: k * c + c / 2, y: -6, transform: `rotate(-55 ${k * c + c / 2} -6)`, "data-k": k }, g, s));
  ROWBOX = el("rect", { class: "rowbox", x: -1, y: 0, width: K * c + 1, height: c + 1, visibility: "hidden", "data-testid": "rowbox" }, g);
  // colour bar
  const lg = el("g", { transform: `translate(${K * c + 14},0)` }, g), n = 40, hgt = Math.min(R * c, 240);
  for (let i = 0; i < n; i++) el("rect", { x: 0, y: hgt - (i + 1) * hgt / n, width: 12, height: hgt / n + 0.5, fill: color(i / (n - 1)) }, lg);
  el("text", { x: 16, y: 10, style: "font-size:11px" }, lg, vmax.toFixed(2));
  el("text", { x: 16, y: hgt, style: "font-size:11px" }, lg, "0");
}

function drawOverview() {
  const cv = document.getElementById("overview"), ctx = cv.getContext("2d");
  const nL = D.layers.length, nH = Math.max(...D.layers.map(L => L.heads.length));
  const t = Math.max(18, Math.min(46, Math.floor(400 / nH))), gap = 4, lab = 26, top = 16;
  const dpr = window.devicePixelRatio || 1;
  const W = lab + nH * (t + gap), Hh = top + nL * (t + gap);
  cv.width = W * dpr; cv.height = Hh * dpr; cv.style.width = W + "px"; cv.style.height = Hh + "px";
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, Hh);
  ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#6b7280";
  for (let h = 0; h < nH; h++) ctx.fillText("h" + h, lab + h * (t + gap) + 2, 11);
  D.layers.forEach((L, li) => {
    ctx.fillStyle = "#6b7280"; ctx.fillText("L" + L.index, 2, top + li * (t + gap) + t / 2 + 3);
    L.heads.forEach((H, hi) => {
      const x0 = lab + hi * (t + gap), y0 = top + li * (t + gap), R = H.w.length, K = L.K;
      for (let r = 0; r < R; r++) for (let k = 0; k < K; k++) {
        ctx.fillStyle = color(H.w[r][k]);
        ctx.fillRect(x0 + k * t / K, y0 + r * t / R, t / K + 0.3, t / R + 0.3);
      }
      if (li === state.layer && hi === state.head) {
        ctx.strokeStyle = "#e4572e"; ctx.lineWidth = 2.5; ctx.strokeRect(x0 - 1.5, y0 - 1.5, t + 3, t + 3);
      }
    });
  });
  document.getElementById("stats").style.maxWidth = Math.max(W, 260) + "px";
  cv.onclick = ev => {
    const r = cv.getBoundingClientRect(), x = ev.clientX - r.left - lab, y = ev.clientY - r.top - top;
    const hi = Math.floor(x / (t + gap)), li = Math.floor(y / (t + gap));
    if (li >= 0 && li < nL && hi >= 0 && hi < D.layers[li].heads.length) select(li, hi);
  };
}

function drawStats() {
  const { L, H } = cur(), box = document.getElementById("stats");
  clear(box);
  const line = document.createElement("div");
  line.textContent = `layer ${L.index}, head ${H.head}: `;
  Object.entries(H.stats).forEach(([k, v], i) => {
    if (i) line.appendChild(document.createTextNode(" · "));
    line.appendChild(document.createTextNode(k + " "));
    const b = document.createElement("b"); b.textContent = v; line.appendChild(b);
  });
  box.appendChild(line);
}

function paint() {
  const { L, H } = cur(), f = state.focus;
  const R = L.rows.length, K = L.K;
  for (let r = 0; r < R; r++) for (let k = 0; k < K; k++) {
    const w = H.w[r][k], line = LINES[r][k];
    const on = f === null ? true : f.q === r;
    line.setAttribute("stroke-width", on ? (1 + 5 * w).toFixed(2) : 1);
    line.setAttribute("stroke-opacity", on ? (f === null ? 0.85 * w : Math.max(0.06, w)).toFixed(3) : 0.0);
    CELLS[r][k].classList.toggle("hl", f !== null && f.q === r);
  }
  L._qtext.forEach((t, r) => { t.classList.toggle("focus", f !== null && f.q === r); t.classList.toggle("dimmed", f !== null && f.q !== r); });
  for (let r = 0; r < R; r++) L["_hq" + r].classList.toggle("focus", f !== null && f.q === r);
  L._keybg.forEach((bg, k) => bg.setAttribute("opacity", f === null ? 0 : (0.75 * H.w[f.q][k]).toFixed(3)));
  const info = document.getElementById("info");
  if (f === null) {
    ROWBOX.setAttribute("visibility", "hidden");
    info.textContent = "Hover a query token (left column or heatmap row) to see where it attends; click to pin.";
    return;
  }
  ROWBOX.setAttribute("visibility", "visible");
  ROWBOX.setAttribute("y", CELLS[f.q][0].getAttribute("y") - 1);
  ROWBOX.dataset.q = f.q;
  const order = [...Array(K).keys()].sort((a, b) => H.w[f.q][b] - H.w[f.q][a]).slice(0, 4)
    .filter((k, i) => i === 0 || H.w[f.q][k] >= 0.01);
  clear(info);
  info.appendChild(document.createTextNode(`${state.pinned ? "pinned" : "query"} `));
  const b = document.createElement("b"); b.textContent = `${qtok(L, f.q)} (#${L.rows[f.q]})`; info.appendChild(b);
  let text = ` attends to: ` + order.map(k => `${ktok(k)} ${H.w[f.q][k].toFixed(2)}`).join(", ");
  if (f.k !== undefined && f.k !== null) text += ` · this cell (key ${ktok(f.k)}): ${H.w[f.q][f.k].toFixed(4)}`;
  info.appendChild(document.createTextNode(text));
}

function hover(q, k) {
  if (state.pinned) return;
  state.focus = q === null ? null : { q, k };
  paint();
}
function pin(q) {
  if (state.pinned && state.focus && state.focus.q === q) { state.pinned = false; state.focus = null; }
  else { state.pinned = true; state.focus = { q }; }
  paint();
}
function select(li, hi) {
  const keep = state.pinned ? state.focus : null;
  state.layer = li; state.head = Math.min(hi, D.layers[li].heads.length - 1);
  state.focus = keep && keep.q < D.layers[li].rows.length ? keep : null;
  state.pinned = state.focus !== null;
  render();
}
function render() {
  fillSelects(); drawShapes(); drawLines(); drawHeatmap(); drawOverview(); drawStats(); paint(); setView(state.view);
}
function setView(v) {
  state.view = v;
  document.querySelectorAll("#views button").forEach(b => b.classList.toggle("on", b.dataset.view === v));
  document.getElementById("lines-view").classList.toggle("hidden", v === "heatmap");
  document.getElementById("heatmap-view").classList.toggle("hidden", v === "lines");
}

document.getElementById("layer").addEventListener("change", e => select(+e.target.value, state.head));
document.getElementById("head").addEventListener("change", e => select(state.layer, +e.target.value));
document.querySelectorAll("#views button").forEach(b => b.addEventListener("click", () => setView(b.dataset.view)));
document.addEventListener("keydown", e => {
  if (e.target.tagName === "SELECT") return;
  const nH = D.layers[state.layer].heads.length, nL = D.layers.length;
  if (e.key === "ArrowRight") select(state.layer, (state.head + 1) % nH);
  else if (e.key === "ArrowLeft") select(state.layer, (state.head + nH - 1) % nH);
  else if (e.key === "ArrowDown") select((state.layer + 1) % nL, state.head);
  else if (e.key === "ArrowUp") select((state.layer + nL - 1) % nL, state.head);
  else if (e.key === "Escape") { state.pinned = false; state.focus = null; paint(); }
  else return;
  e.preventDefault();
});
render();
"""
