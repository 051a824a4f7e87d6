// rpycdl monitor: a job's page. Polls /api/jobs/<id> for its row until it ends, and, for its owner or an
// admin (signed in: common.js), follows a detached job's log through /api/jobs/<id>/log?offset=N. Anyone
// else gets the row reduced (`reduced`: no command, name, error, what it used) and no log. The log is bytes:
// decoded as a stream (a character cut between two reads stays whole) and added as text nodes; the oldest
// are dropped past KEEP characters.
"use strict";

(() => {
  const {el, bytes, duration, need, gpuList, when, clock, times, poll, credentials, FINISHED} = rpycdl;
  const EVERY = 1500;  // ms between two readings of the job's row
  const LOG_EVERY = 1000;  // ms between two readings of its log, once read to its end
  const TAIL = 1024 * 1024;  // bytes of a long log shown at first: its end
  const KEEP = 4 * 1024 * 1024;  // characters of log kept on the page

  const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() || "");
  const $ = (id) => document.getElementById(id);
  $("job-id").textContent = jobId;
  document.title = `rpycdl job ${jobId}`;

  let job = null, answer = null, following = false, stopRow = null;

  function row(label, value, id) {
    if (value === null || value === undefined || value === "") return [];
    return [el("dt", {text: label}), el("dd", {text: value, id: id ? `job-${id}` : undefined})];
  }

  /** CPU time as rpycdl prints it: "0.4s", "12.3s" under a minute, else "3m05s", "1h02m". */
  function cpu(seconds) {
    return Math.round(seconds * 10) / 10 < 60 ? `${seconds.toFixed(1)}s` : duration(Math.round(seconds));
  }

  function renderJob(data) {
    clock.set(data.now);
    rpycdl.account(data);
    job = data.job;
    answer = data;
    const state = $("job-state");
    state.textContent = job.state;
    state.className = `state state-${job.state}`;
    const [waited, ran] = times(job);
    const asked = job.request || {};
    const timeouts = [asked.timeout ? `timeout ${duration(asked.timeout)}` : "",
                      asked.queue_timeout ? `queue timeout ${duration(asked.queue_timeout)}` : ""].filter(Boolean);
    $("details").replaceChildren(
      ...row("state", job.state + (job.cancel_requested && !FINISHED.has(job.state) ? " (cancel requested)" : ""),
             "state-text"),
      ...row("name", job.name),
      ...row("user", job.user),
      ...row("service", `${job.service}, on the server at ${job.server}`),
      ...row("kind", `${job.kind === "call" ? "a function" : job.kind}, ` +
                     (job.detached ? "detached" : "attached" + (job.client ? ` (from ${job.client})` : ""))),
      ...row("details", job.reduced ? `only its owner (${job.user}) and admins see what it runs and used, its ` +
                                      "name, its error and its log" : null, "reduced"),
      ...row("runs", job.what, "command"),
      ...row("asked for", need(job.ngpus, job.share_bytes) + (timeouts.length ? `; ${timeouts.join(", ")}` : "")),
      ...row("place in the queue", job.position ? `${job.position} (1: next)` : null),
      ...row("held back", job.reason || null, "reason"),
      ...row("GPUs", job.gpu_uuids.length
        ? job.gpu_uuids.map((uuid, i) => `${gpuList([job.gpus[i]])}: ${uuid}`).join("\n") : null),
      ...row("submitted", when(job.submitted)),
      ...row("started", job.started ? when(job.started) : null),
      ...row("ended", job.ended ? when(job.ended) : null),
      ...row("waited", waited),
      ...row("ran", job.started ? ran : null),
      ...row("exit code", job.exit_code == null ? null : String(job.exit_code), "exit-code"),
      ...row("error", job.error ? (job.error_type ? `${job.error_type}: ${job.error}` : job.error) : null, "error"),
      ...row("result", job.result_bytes == null ? null : bytes(job.result_bytes)),
      ...row("peak memory", job.peak_memory == null ? null : bytes(job.peak_memory), "peak-memory"),
      ...row("CPU time", job.cpu_seconds == null ? null : cpu(job.cpu_seconds), "cpu"),
      ...row("processes", job.max_procs == null ? null : `${job.max_procs} at most at once`, "max-procs"),
    );
    if (job.log_size != null) $("log-size").textContent = bytes(job.log_size);
    if (FINISHED.has(job.state) && stopRow) {
      stopRow();  // a finished row never changes
      stopRow = null;
      rpycdl.status(`the job ended at ${when(job.ended)}`, false);
    }
    showLog();
  }

  function message(text) {
    $("log-message").textContent = text;
  }

  function showLog() {
    if (following) return;
    if (!job.detached) {
      message("An attached job's output went to its client: there is no log here.");
    } else if (answer.logs) {
      follow();
    } else if (answer.viewer) {
      message(`Only its owner (${job.user}) and admins read its log; you are ${answer.viewer}.`);
    } else if (answer.secret) {
      message("Only its owner and admins read its log: sign in with your user name and the site's shared secret " +
              `(for a job sent with the secret), or come with your client certificate; or: rpycdl logs ${jobId}`);
    } else {
      message("Only its owner and admins read its log, and this monitor cannot tell who you are (it takes neither " +
              `client certificates, --tls-ca, nor the site's secret, --secret-file): rpycdl logs ${jobId}`);
    }
  }

  async function follow() {
    following = true;
    const pre = $("log"), headers = credentials();
    const decoder = new TextDecoder("utf-8");
    let offset = Math.max(0, (job.log_size || 0) - TAIL), kept = 0;
    const partial = offset > 0;
    message(partial ? `The log's last ${bytes(TAIL)}, then live; all of it: rpycdl logs ${jobId}` : "");
    while (true) {
      let response;
      try {
        response = await fetch(`/api/jobs/${encodeURIComponent(jobId)}/log?offset=${offset}`,
                               {headers, cache: "no-store"});
      } catch (error) {
        message(`cannot read the log: ${error.message}; trying again`);
        await sleep(LOG_EVERY * 3);
        continue;
      }
      if (response.status === 401 || response.status === 403) {
        pre.hidden = true;
        $("log-controls").hidden = true;
        message(`The log was refused: ${(await response.text()).trim()}`);
        return;
      }
      if (!response.ok) {
        message(`cannot read the log: ${response.status} ${(await response.text()).trim()}`);
        following = false;
        return;
      }
      const data = new Uint8Array(await response.arrayBuffer());
      const next = Number(response.headers.get("X-Next-Offset"));
      const size = Number(response.headers.get("X-Log-Size"));
      const state = response.headers.get("X-Job-State");
      pre.hidden = false;
      $("log-controls").hidden = false;
      const text = decoder.decode(data, {stream: true});
      if (text) {
        pre.append(document.createTextNode(text));
        kept += text.length;
        while (kept > KEEP && pre.firstChild) {  // the page keeps the log's end
          kept -= pre.firstChild.textContent.length;
          pre.firstChild.remove();
        }
        if ($("follow").checked) pre.scrollTop = pre.scrollHeight;
      }
      $("log-size").textContent = bytes(size);
      offset = next;
      if (offset < size) continue;  // more to read at once
      if (FINISHED.has(state)) {
        const rest = decoder.decode();
        if (rest) pre.append(document.createTextNode(rest));
        pre.dataset.complete = "true";
        message(partial ? `The job ended (${state}); below is the end of its log; all of it: rpycdl logs ${jobId}`
                        : `The job ended (${state}); below is all of its log.`);
        return;
      }
      await sleep(LOG_EVERY);
    }
  }

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  stopRow = poll(`/api/jobs/${encodeURIComponent(jobId)}`, EVERY, renderJob);
})();
