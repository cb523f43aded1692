"use strict";
// The attention page: data in <script id="data">, weights 8 bits per cell (deflate + base64) per head,
// heatmaps and thumbnails painted on canvases, token labels as SVG text thinned to stay readable.
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const VIRIDIS = ["#440154","#472d7b","#3b528b","#2c728e","#21918c","#28ae80","#5ec962","#addc30","#fde725"];
const MASKED = [230, 230, 230];
const LABEL_GAP = 14;   // least pixels between two neighbouring labels
const LABEL_CHARS = 16; // longer tokens are clipped in labels (the info line shows them whole)
const state = { layer: (D.start || [0, 0])[0], head: (D.start || [0, 0])[1], focus: null, pinned: false, view: null, zoom: 1 };

const STOPS = VIRIDIS.map(c => [1, 3, 5].map(i => parseInt(c.slice(i, i + 2), 16)));
function rgb(t) {  // t in [0, 1] → [r, g, b] on viridis
  t = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
  const i = Math.min(Math.floor(t), STOPS.length - 2), f = t - i;
  return STOPS[i].map((a, j) => Math.round(a + (STOPS[i + 1][j] - a) * f));
}
const LUT = Array.from({ length: 256 }, (_, b) => rgb(b / 255));  // byte → colour

async function inflate(text) {  // base64 of zlib bytes → Uint8Array
  const bin = atob(text), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
async function decodeAll() {
  const jobs = [];
  for (const L of D.layers) {
    L.R = L.rows.length;
    for (const H of L.heads) jobs.push(inflate(H.w).then(q => { H.q = q; H.K = L.K; H.w = null; H.maskedRows = new Set(H.masked); }));
  }
  await Promise.all(jobs);
}
function wt(H, r, k) { return H.q[r * H.K + k] * H.scale / 255; }

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
function clip(s) { return s.length > LABEL_CHARS ? s.slice(0, LABEL_CHARS - 1) + "…" : s; }
const MEASURE = document.createElement("canvas").getContext("2d");
function measure(texts) {
  MEASURE.font = "12px " + getComputedStyle(document.body).fontFamily;
  let w = 0;
  for (const s of texts) w = Math.max(w, MEASURE.measureText(s).width);
  return Math.ceil(w);
}
function every(px) { return Math.max(1, Math.ceil(LABEL_GAP / px)); }  // label every n-th token
function setSize(cv, x, y, w, h) {  // a canvas at (x, y), w × h CSS pixels, sharp on any screen
  const dpr = window.devicePixelRatio || 1;
  cv.width = Math.max(1, Math.round(w * dpr)); cv.height = Math.max(1, Math.round(h * dpr));
  Object.assign(cv.style, { left: x + "px", top: y + "px", width: w + "px", height: h + "px" });
  const ctx = cv.getContext("2d"); ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return ctx;
}
function image(L, H) {  // the head as a K × R bitmap (cached), masked rows grey
  if (H.img) return H.img;
  const cv = document.createElement("canvas"); cv.width = L.K; cv.height = L.R;
  const ctx = cv.getContext("2d"), im = ctx.createImageData(L.K, L.R), px = im.data;
  for (let r = 0; r < L.R; r++) {
    const masked = H.maskedRows.has(r);
    for (let k = 0; k < L.K; k++) {
      const c = masked ? MASKED : LUT[H.q[r * L.K + k]], o = 4 * (r * L.K + k);
      px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
    }
  }
  ctx.putImageData(im, 0, 0);
  return (H.img = cv);
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
  extra.textContent = `backend ${L.backend} · mask ${L.mask} · showing b=${D.b}, h=${H.head}: P[b, h] is [Q=${L.R}, K=${L.K}]`;
  box.appendChild(extra);
  document.body.dataset.layer = L.index; document.body.dataset.head = H.head;
}

function tokenEvents(t, r) {
  t.addEventListener("mouseenter", () => hover(r));
  t.addEventListener("mouseleave", () => hover(null));
  t.addEventListener("click", () => pin(r));
}

// ---- lines: each query (left) to each key (right), width and opacity by weight -------------------
let LN = null;
function drawLines() {
  const { L } = cur(), box = document.getElementById("lines-box"), svg = document.getElementById("lines-labels");
  clear(svg);
  const R = L.R, K = L.K, n = Math.max(R, K);
  const rowH = n <= 40 ? 22 : Math.max(3, Math.min(22, Math.floor(760 / n))), pad = 8;
  const qs = L.rows.map((_, r) => clip(qtok(L, r))), ks = [...Array(K).keys()].map(k => clip(ktok(k)));
  const xq = pad + measure(qs), xk = xq + 170, width = xk + measure(ks) + pad + 6, height = n * rowH + 26;
  box.style.width = width + "px"; box.style.height = height + "px";
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  const cy = i => 24 + i * rowH + rowH / 2;
  el("text", { x: xq, y: 12, "text-anchor": "end", class: "axis" }, svg, "query");
  el("text", { x: xk, y: 12, class: "axis" }, svg, "key");
  const step = every(rowH), qtext = new Map(), ktext = new Map();
  for (let r = 0; r < R; r += step) {
    const t = el("text", { x: xq, y: cy(r) + 4, "text-anchor": "end", class: "q", "data-q": r, "data-testid": `q-${r}` }, svg, qs[r]);
    tokenEvents(t, r); qtext.set(r, t);
  }
  for (let k = 0; k < K; k += step) ktext.set(k, el("text", { x: xk, y: cy(k) + 4, class: "k", "data-k": k }, svg, ks[k]));
  const ctx = setSize(document.getElementById("lines"), 0, 0, width, height);
  LN = { ctx, xq, xk, width, height, rowH, cy, qtext, ktext };
  const cv = document.getElementById("lines");
  cv.onmousemove = ev => { const r = Math.floor((ev.offsetY - 24) / rowH); hover(r >= 0 && r < R && ev.offsetX < width / 2 ? r : null); };
  cv.onmouseleave = () => hover(null);
  cv.onclick = ev => { const r = Math.floor((ev.offsetY - 24) / rowH); if (r >= 0 && r < R) pin(r); };
}
function paintLines() {
  if (!LN || state.view === "heatmap") return;
  const { L, H } = cur(), f = state.focus, { ctx, xq, xk, width, height, rowH, cy } = LN;
  ctx.clearRect(0, 0, width, height);
  const scale = Math.min(1, rowH / 22);
  if (f !== null) {  // the focused query's keys, shaded by weight
    ctx.fillStyle = "#2c5aa0";
    for (let k = 0; k < L.K; k++) {
      ctx.globalAlpha = 0.6 * wt(H, f.q, k);
      ctx.fillRect(xk - 3, cy(k) - rowH / 2 + 1, width - xk - 4, Math.max(1, rowH - 2));
    }
  }
  ctx.strokeStyle = "#2c5aa0"; ctx.lineCap = "round";
  const rows = f === null ? [...Array(L.R).keys()] : [f.q];
  for (const r of rows) for (let k = 0; k < L.K; k++) {
    const w = wt(H, r, k);
    if (w < 0.004) continue;
    ctx.globalAlpha = f === null ? 0.85 * w : Math.max(0.06, w);
    ctx.lineWidth = (1 + 5 * w) * scale;
    ctx.beginPath(); ctx.moveTo(xq + 6, cy(r)); ctx.lineTo(xk - 6, cy(k)); ctx.stroke();
  }
  ctx.globalAlpha = 1;
  LN.qtext.forEach((t, r) => { t.classList.toggle("focus", f !== null && f.q === r); t.classList.toggle("dimmed", f !== null && f.q !== r); });
}

// ---- heatmap: P[b, h] on a canvas; labels thinned to every n-th token, the hovered one always shown --
let HM = null, fitWidth = 0;
function drawHeatmap() {
  const { L, H } = cur(), box = document.getElementById("heatmap-box"), svg = document.getElementById("heatmap-labels");
  clear(svg);
  const R = L.R, K = L.K;
  const qs = L.rows.map((_, r) => clip(qtok(L, r))), ks = [...Array(K).keys()].map(k => clip(ktok(k)));
  const left = measure(qs) + 10, top = Math.ceil(measure(ks) * 0.82) + 14, legendW = 64;
  // "fit": the whole grid inside #heatmap-scroll (max-height 100vh − 40 px), neither scrollbar needed
  const col = document.getElementById("views-col").clientWidth, availW = col - 26 - left - legendW;
  const availH = Math.min(760, window.innerHeight - 40 - top - 8);
  const c = Math.max(0.5, Math.min(36, availW / K, availH / R)) * state.zoom;
  fitWidth = col;
  const gw = K * c, gh = R * c, width = left + gw + legendW, height = top + gh + 8;
  box.style.width = width + "px"; box.style.height = height + "px";
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  document.getElementById("heatmap-title").textContent = `P[b=${D.b}, h=${H.head}]: [Q=${R}, K=${K}], layer ${L.index}`;
  const cv = document.getElementById("heatmap"), ctx = setSize(cv, left, top, gw, gh);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(image(L, H), 0, 0, gw, gh);
  cv.dataset.head = H.head; cv.dataset.layer = L.index;
  const g = el("g", { transform: `translate(${left},${top})` }, svg);
  const step = every(c), ylabs = new Map(), xlabs = new Map();
  for (let r = 0; r < R; r += step) {
    const t = el("text", { class: "ylab", x: -6, y: r * c + c / 2 + 4, "text-anchor": "end", "data-q": r, "data-testid": `row-${r}` }, g, qs[r]);
    tokenEvents(t, r); ylabs.set(r, t);
  }
  for (let k = 0; k < K; k += step) {
    const x = k * c + c / 2;
    xlabs.set(k, el("text", { class: "xlab", x, y: -6, transform: `rotate(-55 ${x} -6)`, "data-k": k }, g, ks[k]));
  }
  const curRow = el("text", { class: "cursor", x: -6, "text-anchor": "end", visibility: "hidden", "data-testid": "cursor-row" }, g);
  const curCol = el("text", { class: "cursor", visibility: "hidden", "data-testid": "cursor-col" }, g);
  const rowbox = el("rect", { class: "rowbox", x: -1, y: 0, width: gw + 2, height: c + 2, visibility: "hidden", "data-testid": "rowbox" }, g);
  const colbox = el("rect", { class: "colbox", x: 0, y: -1, width: c + 2, height: gh + 2, visibility: "hidden", "data-testid": "colbox" }, g);
  // colour bar
  const hgt = Math.min(gh, 240), lg = el("g", { transform: `translate(${gw + 12},0)` }, g);
  const grad = el("linearGradient", { id: "cbar", x1: 0, y1: 1, x2: 0, y2: 0 }, el("defs", {}, svg));
  VIRIDIS.forEach((col, i) => el("stop", { offset: i / (VIRIDIS.length - 1), "stop-color": col }, grad));
  el("rect", { x: 0, y: 0, width: 12, height: hgt, fill: "url(#cbar)" }, lg);
  el("text", { x: 16, y: 10, class: "axis" }, lg, H.scale.toFixed(2));
  el("text", { x: 16, y: hgt, class: "axis" }, lg, "0");
  HM = { c, R, K, qs, ks, ylabs, xlabs, curRow, curCol, rowbox, colbox };
  const at = ev => [Math.floor(ev.offsetY / c), Math.floor(ev.offsetX / c)];
  cv.onmousemove = ev => { const [r, k] = at(ev); if (r >= 0 && r < R && k >= 0 && k < K) hover(r, k); };
  cv.onmouseleave = () => hover(null);
  cv.onclick = ev => { const [r] = at(ev); if (r >= 0 && r < R) pin(r); };
}
function paintHeatmap() {
  const f = state.focus, { c, qs, ks, ylabs, xlabs, curRow, curCol, rowbox, colbox } = HM;
  ylabs.forEach((t, r) => t.classList.toggle("focus", f !== null && f.q === r));
  const showRow = f !== null, showCol = f !== null && f.k !== undefined && f.k !== null;
  rowbox.setAttribute("visibility", showRow ? "visible" : "hidden");
  colbox.setAttribute("visibility", showCol ? "visible" : "hidden");
  curRow.setAttribute("visibility", showRow && !ylabs.has(f.q) ? "visible" : "hidden");
  curCol.setAttribute("visibility", showCol && !xlabs.has(f.k) ? "visible" : "hidden");
  xlabs.forEach((t, k) => t.classList.toggle("focus", showCol && f.k === k));
  if (showRow) {
    rowbox.setAttribute("y", f.q * c - 1); rowbox.dataset.q = f.q;
    curRow.setAttribute("y", f.q * c + c / 2 + 4); curRow.textContent = qs[f.q];
  }
  if (showCol) {
    const x = f.k * c + c / 2;
    colbox.setAttribute("x", f.k * c - 1); colbox.dataset.k = f.k;
    curCol.setAttribute("x", x); curCol.setAttribute("y", -6); curCol.setAttribute("transform", `rotate(-55 ${x} -6)`);
    curCol.textContent = ks[f.k];
  }
}

function thumb(L, H, t) {  // the head in t × t pixels, each the largest weight of its block (thin diagonals stay visible)
  if (H.thumb && H.thumb.width === t) return H.thumb;
  const cv = document.createElement("canvas"); cv.width = t; cv.height = t;
  const ctx = cv.getContext("2d"), im = ctx.createImageData(t, t), px = im.data;
  for (let y = 0; y < t; y++) {
    const r0 = Math.floor(y * L.R / t), r1 = Math.max(r0 + 1, Math.floor((y + 1) * L.R / t));
    for (let x = 0; x < t; x++) {
      const k0 = Math.floor(x * L.K / t), k1 = Math.max(k0 + 1, Math.floor((x + 1) * L.K / t));
      let m = 0, masked = true;
      for (let r = r0; r < r1; r++) {
        if (!H.maskedRows.has(r)) masked = false;
        for (let k = k0; k < k1; k++) m = Math.max(m, H.q[r * L.K + k]);
      }
      const c = masked ? MASKED : LUT[m], o = 4 * (y * t + x);
      px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
    }
  }
  ctx.putImageData(im, 0, 0);
  return (H.thumb = cv);
}

// ---- overview: every layer × head as a thumbnail ------------------------------------------------
function drawOverview() {
  const cv = document.getElementById("overview");
  const nL = D.layers.length, nH = Math.max(...D.layers.map(L => L.heads.length));
  const t = Math.max(18, Math.min(46, Math.floor(480 / nH) - 4)), gap = 4, lab = 26, top = 16;
  const W = lab + nH * (t + gap), Hh = top + nL * (t + gap);
  const ctx = setSize(cv, 0, 0, W, Hh);
  cv.style.position = "static";
  ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#6b7280";
  for (let h = 0; h < nH; h++) ctx.fillText("h" + h, lab + h * (t + gap) + 2, 11);
  D.layers.forEach((L, li) => {
    ctx.fillStyle = "#6b7280"; ctx.fillText("L" + L.index, 2, top + li * (t + gap) + t / 2 + 3);
    L.heads.forEach((H, hi) => {
      const x0 = lab + hi * (t + gap), y0 = top + li * (t + gap);
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(Math.max(L.R, L.K) > t ? thumb(L, H, t) : image(L, H), x0, y0, t, t);
      if (li === state.layer && hi === state.head) {
        ctx.strokeStyle = "#e4572e"; ctx.lineWidth = 2.5; ctx.strokeRect(x0 - 1.5, y0 - 1.5, t + 3, t + 3);
      }
    });
  });
  document.getElementById("stats").style.maxWidth = Math.max(W, 260) + "px";
  cv.onclick = ev => {
    const x = ev.offsetX - lab, y = ev.offsetY - top;
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

const HINT = "Hover a query token (left column or heatmap row) to see where it attends; click to pin.";
function paint() {
  const { L, H } = cur(), f = state.focus, info = document.getElementById("info");
  paintLines(); paintHeatmap();
  if (f === null) { info.textContent = HINT; return; }
  const order = [...Array(L.K).keys()].sort((a, b) => wt(H, f.q, b) - wt(H, f.q, a)).slice(0, 4)
    .filter((k, i) => i === 0 || wt(H, f.q, k) >= 0.01);
  clear(info);
  info.appendChild(document.createTextNode(`${state.pinned ? "pinned" : "query"} `));
  const b = document.createElement("b"); b.textContent = `${qtok(L, f.q)} (#${L.rows[f.q]})`; info.appendChild(b);
  let text = " attends to: " + order.map(k => `${ktok(k)} ${wt(H, f.q, k).toFixed(2)}`).join(", ");
  if (f.k !== undefined && f.k !== null) text += ` · this cell (key ${ktok(f.k)} #${f.k}): ${wt(H, f.q, f.k).toFixed(3)}`;
  info.appendChild(document.createTextNode(text));
}

function hover(q, k) {
  if (state.pinned) return;
  const same = q === null ? state.focus === null : state.focus && state.focus.q === q && state.focus.k === k;
  if (same) return;
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
  state.focus = keep && keep.q < D.layers[li].R ? keep : null;
  state.pinned = state.focus !== null;
  render();
}
function render() {  // the overview and stats first: their column's width decides what is left for the heatmap
  fillSelects(); drawShapes(); drawOverview(); drawStats(); setView(state.view, false); drawHeatmap(); drawLines(); paint();
}
function setView(v, redraw = true) {
  state.view = v;
  document.querySelectorAll("#views button").forEach(b => b.classList.toggle("on", b.dataset.view === v));
  document.getElementById("lines-view").classList.toggle("hidden", v === "heatmap");
  document.getElementById("heatmap-view").classList.toggle("hidden", v === "lines");
  if (redraw) { drawHeatmap(); drawLines(); paint(); }
}
function setZoom(z) {
  state.zoom = z;
  document.querySelectorAll("#zoom button").forEach(b => b.classList.toggle("on", +b.dataset.zoom === z));
  drawHeatmap(); paint();
}

document.getElementById("layer").addEventListener("change", e => select(+e.target.value, state.head));
document.getElementById("head").addEventListener("change", e => select(state.layer, +e.target.value));
document.querySelectorAll("#views button").forEach(b => b.addEventListener("click", () => setView(b.dataset.view)));
document.querySelectorAll("#zoom button").forEach(b => b.addEventListener("click", () => setZoom(+b.dataset.zoom)));
document.addEventListener("keydown", e => {
  if (e.target.tagName === "SELECT" || !D.layers[0].heads[0].q) return;
  const nH = D.layers[state.layer].heads.length, nL = D.layers.length;
  if (e.key === "ArrowRight") select(state.layer, (state.head + 1) % nH);
  else if (e.key === "ArrowLeft") select(state.layer, (state.head + nH - 1) % nH);
  else if (e.key === "ArrowDown") select((state.layer + 1) % nL, state.head);
  else if (e.key === "ArrowUp") select((state.layer + nL - 1) % nL, state.head);
  else if (e.key === "Escape") { state.pinned = false; state.focus = null; paint(); }
  else return;
  e.preventDefault();
});
let resizing = null;
window.addEventListener("resize", () => { clearTimeout(resizing); resizing = setTimeout(() => { drawHeatmap(); paint(); }, 100); });
// the views' column can narrow without a window resize (the overview's column widening): fit again
new ResizeObserver(() => requestAnimationFrame(() => {
  if (HM && document.getElementById("views-col").clientWidth !== fitWidth) { drawHeatmap(); paint(); }
})).observe(document.getElementById("views-col"));

(async () => {
  if (D.notice) { const n = document.getElementById("notice"); n.textContent = D.notice; n.classList.remove("hidden"); }
  await decodeAll();
  const n = Math.max(...D.layers.map(L => Math.max(L.R, L.K)));
  state.view = n <= 48 ? "both" : "heatmap";
  render();
  document.body.dataset.ready = "1";
})();
