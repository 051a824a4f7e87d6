// rpycdl monitor: helpers shared by the dashboard's pages. Everything shown is data from the host
// (user names, commands, errors, logs: untrusted), so it only ever enters the DOM as text
// (textContent, text nodes, properties); nothing here parses HTML. Who looks is who their client
// certificate says (the browser sends it), or the user name they sign in with, with the site's shared
// secret (kept for this tab only, in sessionStorage, and sent as HTTP Basic auth with every request).
"use strict";

const rpycdl = (() => {
  /** An element: el("td", {text: "x", className: "state"}, child, ...). Props are set as properties. */
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node[key] = value;
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);  // a string becomes a text node
    }
    return node;
  }

  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

  /** Bytes in words, as rpycdl prints them: "0 B", "512 MiB", "79.6 GiB". */
  function bytes(n) {
    if (n === null || n === undefined) return "?";
    let size = Number(n), unit = 0;
    while (Math.abs(Math.round(size * 10) / 10) >= 1024 && unit < UNITS.length - 1) {
      size /= 1024;
      unit += 1;
    }
    return `${size.toFixed(1).replace(/\.0$/, "")} ${UNITS[unit]}`;
  }

  /** A duration in words, as rpycdl prints them: "45s", "3m05s", "2h07m", "3d04h". */
  function duration(seconds) {
    let s = Math.max(0, Math.floor(seconds));
    for (const [unit, size, smaller, small] of [["d", 86400, "h", 3600], ["h", 3600, "m", 60], ["m", 60, "s", 1]]) {
      if (s >= size) {
        const rest = Math.floor((s % size) / small);
        return `${Math.floor(s / size)}${unit}` + (rest ? `${String(rest).padStart(2, "0")}${smaller}` : "");
      }
    }
    return `${s}s`;
  }

  /** What a request asks for: "2 GPUs", "all GPUs", "4 GiB of one GPU". */
  function need(ngpus, shareBytes) {
    if (shareBytes) return `${bytes(shareBytes)} of one GPU`;
    if (ngpus < 0) return "all GPUs";
    return ngpus === 1 ? "1 GPU" : `${ngpus} GPUs`;
  }

  /** GPU indices as text: "0, 1" ("?" for one this monitor does not know). */
  function gpuList(indices) {
    return (indices || []).map((index) => (index < 0 ? "?" : String(index))).join(", ");
  }

  /** A time of the host as local time: "14:03:07" today, "2024-05-01 14:03" before. */
  function when(seconds) {
    if (!seconds) return "";
    const date = new Date(seconds * 1000), today = new Date();
    const pad = (n) => String(n).padStart(2, "0");
    const time = `${pad(date.getHours())}:${pad(date.getMinutes())}`;
    if (date.toDateString() === today.toDateString()) return `${time}:${pad(date.getSeconds())}`;
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ${time}`;
  }

  /** The host's clock, as its last answer gave it (waits are computed with the host's time). */
  const clock = {
    offset: 0,
    set(hostNow) { this.offset = hostNow - Date.now() / 1000; },
    now() { return Date.now() / 1000 + this.offset; },
  };

  /** How long a job waited and ran, as text: [waited, ran]. */
  function times(job) {
    const now = clock.now();
    const waited = duration((job.started || job.ended || now) - job.submitted);
    const ran = job.started ? duration((job.ended || now) - job.started) : "-";
    return [waited, ran];
  }

  /** The link to a job's page. */
  function jobHref(jobId) {
    return `/jobs/${encodeURIComponent(jobId)}`;
  }

  /** Show how the page is doing: live (with the time of the last answer), or what went wrong. */
  function status(text, failed) {
    const node = document.getElementById("status");
    node.textContent = text;
    node.classList.toggle("error", Boolean(failed));
  }

  const LOGIN = "rpycdl-monitor-login";  // {user, secret} in sessionStorage

  /** The headers that say who looks: HTTP Basic auth of the user name and secret signed in with ({}: none). */
  function credentials() {
    const login = JSON.parse(sessionStorage.getItem(LOGIN) || "null");
    if (!login) return {};
    const encoded = new TextEncoder().encode(`${login.user}:${login.secret}`);  // UTF-8, whatever the characters
    return {Authorization: `Basic ${btoa(String.fromCharCode(...encoded))}`};
  }

  /** Show who looks (`data.viewer`) in the header, with the sign-in form where the monitor takes the site's
   *  secret (`data.secret`) and nobody is signed in, or a button to sign out. */
  function account(data) {
    const signedIn = Boolean(sessionStorage.getItem(LOGIN));
    document.getElementById("viewer").textContent = data.viewer ? `you are ${data.viewer}` : "";
    document.getElementById("login").hidden = signedIn || !data.secret || Boolean(data.viewer);
    document.getElementById("logout").hidden = !signedIn;
  }

  function signIn(event) {
    event.preventDefault();
    const user = document.getElementById("login-user").value.trim();
    const secret = document.getElementById("login-secret").value.trim();
    if (!user || !secret) return;
    sessionStorage.setItem(LOGIN, JSON.stringify({user, secret}));
    location.reload();  // everything again, as that user sees it
  }

  function signOut() {
    sessionStorage.removeItem(LOGIN);
    location.reload();
  }

  document.getElementById("login").addEventListener("submit", signIn);
  document.getElementById("logout").addEventListener("click", signOut);

  /** Fetch `url` as JSON every `every` ms (one request at a time; slower while the tab is hidden), and give
   *  each answer to `onData`. Returns a function that stops it. */
  function poll(url, every, onData) {
    let stopped = false, timer = null;
    async function once() {
      try {
        const response = await fetch(url, {cache: "no-store", headers: credentials()});
        if ((response.status === 401 || response.status === 403) && sessionStorage.getItem(LOGIN)) {
          sessionStorage.removeItem(LOGIN);  // a wrong secret: looked at as nobody, the next time
          document.getElementById("logout").hidden = true;
        }
        if (!response.ok) throw new Error(`${response.status} ${(await response.text()).trim()}`);
        const data = await response.json();
        if (!stopped) {
          status(`live, updated ${when(Date.now() / 1000)}`, false);
          onData(data);  // which may stop the polling, and say so
        }
      } catch (error) {
        if (!stopped) status(`cannot read the monitor: ${error.message}`, true);
      }
      if (!stopped) timer = setTimeout(once, document.hidden ? every * 5 : every);
    }
    once();
    return () => { stopped = true; clearTimeout(timer); };
  }

  /** A table cell from its description: a string, or {text, className, href, title}. */
  function cell(spec) {
    const info = typeof spec === "object" && spec !== null ? spec : {text: spec};
    const td = el("td", {className: info.className || "", title: info.title || ""});
    if (info.href) td.append(el("a", {href: info.href, text: info.text}));
    else td.textContent = info.text === null || info.text === undefined ? "" : String(info.text);
    return td;
  }

  /** Make `tbody` show `items` in order, a row each, keyed by `keyOf(item)`: rows are made once, their
   *  cells rewritten only when what they show (`cellsOf(item)`, a list of cell descriptions) changed, and
   *  moved only when out of place. So a thousand rows cost little to keep up to date. */
  function syncRows(tbody, items, keyOf, cellsOf) {
    const rows = tbody._rows || (tbody._rows = new Map());
    const wanted = new Set();
    items.forEach((item, position) => {
      const key = String(keyOf(item));
      wanted.add(key);
      const cells = cellsOf(item);
      const signature = JSON.stringify(cells);
      let row = rows.get(key);
      if (!row) {
        row = el("tr", {dataset: {key}});
        rows.set(key, row);
      }
      if (row._signature !== signature) {
        row.replaceChildren(...cells.map(cell));
        row._signature = signature;
      }
      const here = tbody.children[position];
      if (here !== row) tbody.insertBefore(row, here || null);
    });
    for (const [key, row] of rows) {
      if (!wanted.has(key)) {
        row.remove();
        rows.delete(key);
      }
    }
  }

  const FINISHED = new Set(["SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT", "LOST"]);

  return {el, bytes, duration, need, gpuList, when, clock, times, jobHref, status, poll, syncRows, credentials, account,
          FINISHED};
})();
