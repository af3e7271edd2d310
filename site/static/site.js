// The site's few behaviours, each active only where its elements exist:
// * index: the tag filter. A button shows only the rows carrying its tag; the choice lives in
//   the URL fragment (#tag=...) so that a tag link on a post-mortem page lands filtered.
// * post-mortem pages: "show all code" opens or folds every code input (each is a <details>);
//   a long table's "N more rows" button unfolds its hidden rows (varlen_workbench.workbench.postmortem.Table).
// * figures: one shown scaled down to the page's width opens full size on a tap, a click or Enter,
//   over the page (the lightbox); a tap, Escape or its close button closes it.
(function () {
  "use strict";
  var all = function (selector) { return Array.prototype.slice.call(document.querySelectorAll(selector)); };

  // -- tag filter (index) --
  var buttons = all(".wb-tag-filter");
  var rows = all("table.wb-postmortems tbody tr[data-tags]");

  function show(tag) {
    rows.forEach(function (row) {
      row.hidden = tag !== "" && JSON.parse(row.dataset.tags).indexOf(tag) < 0;  // tags may hold spaces
    });
    buttons.forEach(function (button) {
      button.setAttribute("aria-pressed", String(button.dataset.tag === tag));
    });
  }

  function fromHash() {
    var match = /^#tag=(.*)$/.exec(window.location.hash);
    var tag = match ? decodeURIComponent(match[1]) : "";
    show(buttons.some(function (b) { return b.dataset.tag === tag; }) ? tag : "");
  }

  if (buttons.length) {
    buttons.forEach(function (button) {
      button.addEventListener("click", function () {
        var tag = button.dataset.tag;
        history.replaceState(null, "", tag ? "#tag=" + encodeURIComponent(tag) : window.location.pathname);
        show(tag);
      });
    });
    window.addEventListener("hashchange", fromHash);
    fromHash();
  }

  // -- code folding (post-mortem pages) --
  all(".wb-code-all").forEach(function (toggle) {
    toggle.addEventListener("click", function () {
      var open = toggle.getAttribute("aria-pressed") !== "true";
      all("details.wb-code").forEach(function (d) { d.open = open; });
      toggle.setAttribute("aria-pressed", String(open));
      toggle.textContent = open ? "fold all code" : "show all code";
    });
  });

  // -- long tables --
  all("button.wb-more-rows").forEach(function (button) {
    var table = button.closest("table");
    var folded = table && table.querySelector("tbody.wb-folded-rows");
    if (!folded) { return; }
    var label = button.textContent;
    button.setAttribute("aria-expanded", "false");
    button.addEventListener("click", function () {
      folded.hidden = !folded.hidden;
      button.setAttribute("aria-expanded", String(!folded.hidden));
      button.textContent = folded.hidden ? label : "fewer rows";
    });
  });

  // -- figures full size --
  var figures = all(".jp-RenderedImage img, img.wb-explorer-img");
  if (!figures.length) { return; }
  var box = document.createElement("div");
  box.className = "wb-lightbox";
  box.hidden = true;
  box.setAttribute("role", "dialog");
  box.setAttribute("aria-label", "figure, full size");
  var big = null;  // made when a figure opens and removed when it shuts: no empty image in the page
  var close = document.createElement("button");
  close.type = "button";
  close.className = "wb-lightbox-close";
  close.textContent = "close";
  box.appendChild(close);
  document.body.appendChild(box);
  var opener = null;

  function shut() {
    box.hidden = true;
    if (big) { box.removeChild(big); big = null; }
    if (opener) { opener.focus(); }
  }
  function open(figure) {
    opener = figure;
    if (big) { box.removeChild(big); }
    big = document.createElement("img");
    box.appendChild(big);
    big.src = figure.currentSrc || figure.src;  // an explorer's current frame
    big.alt = figure.alt;
    box.hidden = false;
    box.scrollTo(0, 0);
    close.focus();
  }
  box.addEventListener("click", shut);
  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape" && !box.hidden) { shut(); }
  });
  // Only a figure drawn smaller than its pixels gains from opening; the page's width decides which.
  function mark() {
    figures.forEach(function (figure) {
      var scaled = figure.naturalWidth > figure.clientWidth + 1;
      figure.classList.toggle("wb-zoomable", scaled);
      if (scaled) {
        figure.setAttribute("tabindex", "0");
        figure.setAttribute("role", "button");
        figure.setAttribute("aria-label", "open full size: " + figure.alt);
      } else {
        ["tabindex", "role", "aria-label"].forEach(function (name) { figure.removeAttribute(name); });
      }
    });
  }
  figures.forEach(function (figure) {
    figure.addEventListener("click", function () { if (figure.classList.contains("wb-zoomable")) { open(figure); } });
    figure.addEventListener("keydown", function (event) {
      if ((event.key === "Enter" || event.key === " ") && figure.classList.contains("wb-zoomable")) {
        event.preventDefault();
        open(figure);
      }
    });
    if (!figure.complete) { figure.addEventListener("load", mark); }
  });
  window.addEventListener("resize", mark);
  mark();
})();
