// Tag filter of the index: a button shows only the rows carrying its tag; the choice lives in
// the URL fragment (#tag=...) so that a tag link on a post-mortem page lands filtered.
(function () {
  "use strict";
  var buttons = Array.prototype.slice.call(document.querySelectorAll(".wb-tag-filter"));
  var rows = Array.prototype.slice.call(document.querySelectorAll("table.wb-postmortems tbody tr[data-tags]"));

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

  buttons.forEach(function (button) {
    button.addEventListener("click", function () {
      var tag = button.dataset.tag;
      history.replaceState(null, "", tag ? "#tag=" + encodeURIComponent(tag) : window.location.pathname);
      show(tag);
    });
  });
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
