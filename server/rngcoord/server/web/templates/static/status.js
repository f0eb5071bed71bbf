// The status page's live refresh and its filter. A file of its own (not inline) so that the
// page's Content-Security-Policy can allow scripts from this origin only.
(function () {
  "use strict";
  const root = document.getElementById("status");
  if (!root) return;
  let lastId = Number(root.dataset.lastId);
  const refreshMs = Number(root.dataset.refreshMs) || 1000;
  const keep = 200;
  const state = document.getElementById("refresh-state");
  const filter = document.getElementById("filter");
  const toggles = [...document.querySelectorAll("input.show-state")];
  const count = document.getElementById("filter-count");

  function applyFilter() {
    const words = filter.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
    const shown = new Set(toggles.filter((t) => t.checked).map((t) => t.value));
    let visible = 0;
    let total = 0;
    for (const job of document.querySelectorAll("#groups .job")) {
      total += 1;
      const names = job.dataset.names.toLowerCase();
      const show = shown.has(job.dataset.state) && words.every((w) => names.includes(w));
      job.hidden = !show;
      if (show) visible += 1;
    }
    for (const section of document.querySelectorAll("#groups section.state")) {
      section.hidden = !section.querySelector(".job:not([hidden])");
    }
    count.textContent = visible === total ? "" : `showing ${visible} of ${total} jobs`;
  }

  function cell(row, text, cls) {
    const td = row.insertCell();
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (cls) td.className = cls;
  }

  async function refreshGroups() {
    const r = await fetch("/partials/groups", {credentials: "same-origin"});
    if (r.status === 401) {
      // The session ended (expiry, sign-out elsewhere, or a token reload): sign in again.
      window.location.assign("/login");
      return;
    }
    if (!r.ok) throw new Error("groups: HTTP " + r.status);
    document.getElementById("groups").innerHTML = await r.text();
    applyFilter();
  }

  async function refreshAudit() {
    const r = await fetch("/api/audit?after=" + lastId, {credentials: "same-origin"});
    if (!r.ok) throw new Error("audit: HTTP " + r.status);
    const body = await r.json();
    const rows = document.getElementById("audit-rows");
    // Oldest first from the API; each goes on top, so the newest ends first.
    for (const rec of body.records) {
      const row = rows.insertRow(0);
      row.className = "record";
      row.dataset.id = rec.id;
      row.title = rec.title;
      cell(row, rec.id, "num");
      cell(row, rec.time, "time");
      cell(row, rec.kind, "kind kind-" + rec.kind);
      cell(row, rec.job, "name");
      cell(row, rec.group, "name");
      cell(row, rec.epoch, "num");
      cell(row, rec.range, "num range");
      cell(row, rec.summary, "summary");
      cell(row, rec.actor, "actor");
    }
    lastId = body.last_id;
    while (rows.rows.length > keep) rows.deleteRow(rows.rows.length - 1);
  }

  async function tick() {
    try {
      await Promise.all([refreshGroups(), refreshAudit()]);
      state.textContent = "";
    } catch (e) {
      state.textContent = "(refresh failed: " + e.message + "; retrying)";
    }
    setTimeout(tick, refreshMs);
  }

  filter.addEventListener("input", applyFilter);
  for (const t of toggles) t.addEventListener("change", applyFilter);
  applyFilter();
  setTimeout(tick, refreshMs);
})();
