// Zattera console: live updates over Server-Sent Events. No framework, no build step.
// /live?page=P says "something this page shows changed": the page is fetched again and each [data-live]
// region whose content differs is swapped in. [data-follow] elements append the lines their stream sends.
"use strict";

(function () {
  const body = document.body;

  function swapLiveRegions(html) {
    const fresh = new DOMParser().parseFromString(html, "text/html");
    for (const next of fresh.querySelectorAll("[data-live][id]")) {
      const current = document.getElementById(next.id);
      if (current && current.innerHTML !== next.innerHTML && !current.contains(document.activeElement)) {
        current.innerHTML = next.innerHTML;
      }
    }
    body.dataset.revision = fresh.body.dataset.revision || body.dataset.revision;
  }

  function followChanges(page) {
    let fetching = false;
    let again = false;
    async function refresh() {
      if (fetching) { again = true; return; }
      fetching = true;
      try {
        do {
          again = false;
          const response = await fetch(location.href, { credentials: "same-origin", cache: "no-store" });
          if (response.redirected || !response.ok) { return; }
          swapLiveRegions(await response.text());
        } while (again);
      } finally {
        fetching = false;
      }
    }
    const source = new EventSource("/live?page=" + encodeURIComponent(page));
    source.addEventListener("change", refresh);
    source.addEventListener("open", refresh);  // a reconnect may have missed changes
  }

  function followLines(element) {
    const source = new EventSource(element.dataset.follow);
    const keep = 1000;
    source.addEventListener("line", (event) => {
      const line = JSON.parse(event.data);
      const atBottom = element.scrollTop + element.clientHeight >= element.scrollHeight - 4;
      const row = document.createElement("span");
      row.className = line.error ? "line line-error" : "line";
      row.textContent = line.text + "\n";
      element.appendChild(row);
      while (element.childNodes.length > keep) { element.removeChild(element.firstChild); }
      if (atBottom) { element.scrollTop = element.scrollHeight; }
    });
  }

  document.addEventListener("submit", (event) => {
    const question = event.target.dataset.confirm;
    if (question && !window.confirm(question)) { event.preventDefault(); }
  });

  if (body.dataset.livePage) { followChanges(body.dataset.livePage); }
  for (const element of document.querySelectorAll("[data-follow]")) { followLines(element); }
})();
