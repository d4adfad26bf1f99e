// The broker's pages: live countdowns, a refresh of the page's data every few seconds
// (a 304 when nothing changed), and the actions (POST with the XSRF token). No framework.
"use strict";
(() => {
  const body = document.body;
  const base = body.dataset.base;
  const xsrf = body.dataset.xsrf;
  const flash = document.getElementById("flash");
  const live = document.getElementById("live");

  const say = (text, bad) => {
    flash.textContent = text;
    flash.className = bad ? "problem" : "done";
  };

  const span = (seconds) => {
    seconds = Math.max(0, Math.floor(seconds));
    if (seconds < 60) return `${seconds} s`;
    const minutes = Math.floor(seconds / 60);
    if (minutes < 60) return `${minutes} min ${seconds % 60} s`;
    const hours = Math.floor(minutes / 60);
    return `${hours} h ${minutes % 60} min`;
  };

  const tick = () => {
    const now = Date.now() / 1000;
    for (const el of document.querySelectorAll(".countdown[data-until]")) {
      const left = Number(el.dataset.until) - now;
      el.textContent = left > 0 ? `${span(left)} left` : "ended";
    }
  };

  let etag = null;
  const refresh = async () => {
    if (!live) return;
    const query = live.dataset.query ? `?${live.dataset.query}` : "";
    const headers = etag ? { "If-None-Match": etag } : {};
    let response;
    try {
      response = await fetch(`${base}ui/fragment/${live.dataset.fragment}${query}`, {
        headers, cache: "no-store", credentials: "same-origin",
      });
    } catch (err) {
      say("The broker does not answer; retrying.", true);
      return;
    }
    if (response.status === 304) return;
    if (response.status === 401) {
      say("You are logged out: reload the page to log in again.", true);
      return;
    }
    if (!response.ok) return;
    etag = response.headers.get("Etag");
    const focused = document.activeElement && document.activeElement.id;
    live.innerHTML = await response.text();
    if (focused && live.querySelector(`#${CSS.escape(focused)}`)) {
      document.getElementById(focused).focus();
    }
    tick();
  };

  // A POST with the XSRF token: the answer's JSON, or null once the refusal is said.
  const ask = async (path, data) => {
    const response = await fetch(base + path, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-XSRFToken": xsrf },
      body: JSON.stringify(data || {}),
    });
    let answer = {};
    try { answer = await response.json(); } catch (err) { /* not JSON */ }
    if (response.ok) return answer;
    say((answer.error && answer.error.message) || `Refused (${response.status}).`, true);
    return null;
  };

  const post = async (path, data) => {
    const answer = await ask(path, data);
    if (answer) say(answer.message || "Done.", false);
    etag = null;
    await refresh();
  };

  // A change to the project tree says first whose entitlements it moves, and asks.
  const postProject = async (path, data) => {
    const preview = await ask(path, { ...data, preview: true });
    if (!preview) return;
    const moves = preview.changes.map((c) => `${c.name}: ${c.before} → ${c.after}`);
    if (moves.length && !window.confirm(`This changes entitlements:\n${moves.join("\n")}\nApply?`)) {
      say("Not applied: nothing changed.", false);
      return;
    }
    await post(path, data);
  };

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-post]");
    if (!button) return;
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    post(button.dataset.post, button.dataset.body ? JSON.parse(button.dataset.body) : {});
  });

  const list = (text) => text.split(",").map((s) => s.trim()).filter(Boolean);
  for (const form of document.querySelectorAll("form.admin")) {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const f = new FormData(form);
      if (form.dataset.kind === "node") {
        const action = event.submitter ? event.submitter.value : "drain";
        if (action === "down" && !window.confirm(`Mark ${f.get("node")} down? Every slice on it ends now.`)) return;
        post(`ui/nodes/${encodeURIComponent(f.get("node"))}/${action}`, { reason: f.get("reason") || "" });
      } else {
        const data = { share: Number(f.get("share")) };
        if (f.get("parent")) data.parent = f.get("parent");
        if (f.get("top_level")) data.top_level = true;
        if (f.get("users")) data.users = list(f.get("users"));
        if (f.get("groups")) data.groups = list(f.get("groups"));
        postProject(`ui/projects/${encodeURIComponent(f.get("name"))}`, data);
      }
    });
  }

  tick();
  setInterval(tick, 1000);
  if (live) setInterval(refresh, Number(live.dataset.refresh) || 3000);
  window.slicebrokerRefresh = refresh; // lets a test (or a console) refresh now
})();
