"use strict";
// English / 中文: every text carries both (data-l); the toggle sets html[data-ui] and html[lang].
function setLang(l) {
  document.documentElement.dataset.ui = l;
  document.documentElement.lang = l === "zh" ? "zh-CN" : "en";
  document.querySelectorAll("#lang button").forEach(b => b.classList.toggle("on", b.dataset.set === l));
}
document.querySelectorAll("#lang button").forEach(b => b.addEventListener("click", () => setLang(b.dataset.set)));
setLang(location.hash === "#zh" ? "zh" : location.hash === "#en" ? "en" : document.documentElement.dataset.ui);
