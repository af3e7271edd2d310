// The site's few behaviours, each active only where its elements exist:
// * index: the tag filter. A button shows only the rows carrying its tag; the choice lives in
//   the URL fragment (#tag=...) so that a tag link on a post-mortem page lands filtered.
// * post-mortem pages: "show all code" opens or folds every code input (each is a <details>);
//   a long table's "N more rows" button unfolds its hidden rows (varlen_workbench.workbench.postmortem.Table).
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
})();
