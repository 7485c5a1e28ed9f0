// Zattera console: live updates over Server-Sent Events. No framework, no build step.
// /live?page=P says "something this page shows changed": the page is fetched again and each [data-live]
// region whose content differs is swapped in. [data-follow] elements append the lines their stream sends.
"use strict";

(function () {
  const body = document.body;

  // Swap the regions matching `selector` whose content differs; a focused region is left alone.
  function swapLiveRegions(html, selector) {
    const fresh = new DOMParser().parseFromString(html, "text/html");
    for (const next of fresh.querySelectorAll(selector)) {
      const current = document.getElementById(next.id);
      if (current && current.innerHTML !== next.innerHTML && !current.contains(document.activeElement)) {
        current.innerHTML = next.innerHTML;
      }
    }
    body.dataset.revision = fresh.body.dataset.revision || body.dataset.revision;
  }

  // A change names the rows it touches (`envs`) when it can: only those rows are fetched and swapped,
  // so a page of a thousand environments updates as fast as a page of one. Otherwise the whole page.
  function followChanges(page) {
    let fetching = false;
    let whole = false;
    const rows = new Set();
    async function refresh() {
      if (fetching) { return; }
      fetching = true;
      try {
        while (whole || rows.size) {
          const partial = !whole && [...rows].every((id) => document.getElementById("env-" + id));
          const url = new URL(location.href);
          if (partial) { url.searchParams.set("only", [...rows].join(",")); }
          whole = false;
          rows.clear();
          const response = await fetch(url, { credentials: "same-origin", cache: "no-store", headers: { "X-Console-Live": "1" } });
          if (response.redirected || !response.ok) { return; }
          swapLiveRegions(await response.text(), partial ? "[data-row][id]" : "[data-live][id]:not([data-row])");
        }
      } finally {
        fetching = false;
      }
    }
    const only = body.dataset.liveEnv ? "&env=" + encodeURIComponent(body.dataset.liveEnv) : "";
    const source = new EventSource("/live?page=" + encodeURIComponent(page) + only);
    source.addEventListener("change", (event) => {
      const change = JSON.parse(event.data);
      if (page === "overview" && change.envs) { change.envs.forEach((id) => rows.add(id)); } else { whole = true; }
      refresh();
    });
    // The overview's sparklines change with time, not with the state: the rows on screen are fetched again
    // every 30 s (the server reads the history once per 30 s for every row).
    if (page === "overview") {
      setInterval(() => {
        if (document.hidden) { return; }
        for (const row of document.querySelectorAll("li.env[id^='env-']")) {
          const box = row.getBoundingClientRect();
          if (box.bottom > 0 && box.top < window.innerHeight) { rows.add(row.id.slice(4)); }
        }
        if (rows.size) { refresh(); }
      }, 30000);
    }
    // Each (re)connection starts with the current revision: changes missed meanwhile refresh the page.
    source.addEventListener("hello", (event) => {
      if (String(JSON.parse(event.data).revision) !== body.dataset.revision) { whole = true; refresh(); }
    });
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

  // [data-poll] regions (the charts) change with time, not with the state: fetched again every 10 s.
  function poll(element) {
    async function refresh() {
      if (document.hidden || element.contains(document.activeElement)) { return; }
      try {
        const response = await fetch(element.dataset.poll, { credentials: "same-origin", cache: "no-store", headers: { "X-Console-Live": "1" } });
        if (!response.ok || response.redirected) { return; }
        const html = await response.text();
        if (element.innerHTML.trim() !== html.trim()) { element.innerHTML = html; }
      } catch (error) { /* offline for a moment: the next tick tries again */ }
    }
    setInterval(refresh, Number(element.dataset.pollSeconds || 10) * 1000);
  }

  if (body.dataset.livePage) { followChanges(body.dataset.livePage); }
  for (const element of document.querySelectorAll("[data-poll]")) { poll(element); }
  for (const element of document.querySelectorAll("[data-follow]")) { followLines(element); }
})();
