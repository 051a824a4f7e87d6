// rpycdl monitor: the host's page. Polls /api/host and shows its GPUs (memory granted and used, holders),
// the queue in order (with why a job over its owner's limits waits), each user's and group's use against the
// limits in force, and the recent jobs; everything as text (see common.js). Others' jobs come reduced
// (`reduced`: no name, command or error, which only their owners and admins see): shown as "-".
"use strict";

(() => {
  const {el, bytes, duration, need, gpuList, when, clock, times, jobHref, poll, syncRows} = rpycdl;
  const EVERY = 1500;  // ms between two readings of /api/host (the monitor reads the host once a second at most)

  function percent(part, total) {
    return total ? Math.max(0, Math.min(100, (100 * part) / total)) : 0;
  }

  const HIDDEN = "-";  // what a reduced row shows of a field only its owner and admins see

  function holderText(holder) {
    return holder.name ? `${holder.job_id} (${holder.name})` : holder.job_id;
  }

  function named(row) {
    return row.reduced ? HIDDEN : row.name || "";
  }

  function gpuCard(gpu) {
    const now = clock.now();
    const used = gpu.memory_used, util = gpu.utilization;
    const figures = [`granted ${bytes(gpu.memory_granted)} of ${bytes(gpu.memory_total)}`,
                     `used ${used === null ? "unknown" : bytes(used)}`];
    if (util !== null) figures.push(`busy ${Math.round(util * 100)}%`);
    const granted = el("div", {className: "bar granted", title: "memory granted, by holder"});
    gpu.holders.forEach((holder, index) => {
      const width = holder.kind === "whole" ? 100 : percent(holder.share_bytes, gpu.memory_total);
      const kind = holder.leftover ? "leftover" : holder.kind + (index % 2 ? " odd" : "");
      const segment = el("div", {className: `seg ${kind}`, text: holder.user,
                                 title: `${holder.user}: job ${holderText(holder)}, ${holder.kind}` +
                                        (holder.kind === "share" ? ` ${bytes(holder.share_bytes)}` : "")});
      segment.style.width = `${width}%`;
      granted.append(segment);
    });
    const fill = el("div", {className: "fill" + (used > gpu.memory_granted ? " over" : "")});
    fill.style.width = `${percent(used || 0, gpu.memory_total)}%`;
    const usedBar = el("div", {className: "bar used", title: "memory in use"}, fill);
    const holders = el("ul", {className: "holders"});
    for (const holder of gpu.holders) {
      holders.append(el("li", {dataset: {job: holder.job_id}},
        el("a", {href: jobHref(holder.job_id), text: holderText(holder)}),
        el("span", {className: "user", text: holder.user}),
        el("span", {className: "kind",
                    text: (holder.kind === "whole" ? "whole GPU" : `share of ${bytes(holder.share_bytes)}`) +
                          (holder.since ? `, for ${duration(now - holder.since)}` : "") +
                          (holder.leftover ? ", leftover: its holder died, its processes run" : "")}),
        holder.service ? el("span", {className: "kind", text: holder.service}) : null));
    }
    if (!gpu.holders.length) holders.append(el("li", {className: "idle", text: "free"}));
    return el("div", {className: "gpu", dataset: {uuid: gpu.uuid, index: String(gpu.index)}},
      el("div", {className: "gpu-head"},
        el("span", {}, el("span", {className: "gpu-name", text: `GPU ${gpu.index}`}),
           el("span", {className: "gpu-model", text: gpu.model})),
        el("span", {className: "figures", text: figures.join(" · ")})),
      granted, usedBar, holders);
  }

  function renderGpus(gpus) {
    const box = document.getElementById("gpus");
    box.replaceChildren(...gpus.map(gpuCard));  // a few cards: rebuilt whole
    if (!gpus.length) box.append(el("p", {className: "empty", text: "No GPUs: is --gpus right?"}));
  }

  function renderQueue(queue) {
    const now = clock.now();
    document.getElementById("queue-count").textContent = queue.length ? `${queue.length} waiting` : "";
    document.getElementById("queue-empty").hidden = queue.length > 0;
    document.getElementById("queue").hidden = queue.length === 0;
    syncRows(document.querySelector("#queue tbody"), queue, (entry) => entry.job_id, (entry) => [
      String(entry.position),
      {text: entry.job_id, href: jobHref(entry.job_id), className: "id"},
      named(entry),
      entry.user,
      entry.service,
      need(entry.ngpus, entry.share_bytes),
      gpuList(entry.gpus),
      entry.since ? duration(now - entry.since) : "",
      {text: entry.reason || "", className: "why"},
    ]);
  }

  const LIMITED = ["gpus", "gpu_hours_day", "gpu_hours_week", "pending"];  // the limits panel's columns, in order

  /** A use against its limit: "1 / 1", "3.5 / 200.0" (GPU-hours), or the use alone where no limit binds. */
  function against(row, key) {
    const round = (n) => (key.startsWith("gpu_hours") ? Number(n).toFixed(1) : String(Number(Number(n).toFixed(2))));
    const limit = row.limits[key];
    return {text: limit === undefined ? round(row[key]) : `${round(row[key])} / ${round(limit)}`,
            className: limit !== undefined && row[key] >= limit ? "at-limit" : ""};
  }

  // Each user's and group's use against the limits in force (rpycdl serve --limits); hidden while none are.
  function renderLimits(rows) {
    document.getElementById("limits-section").hidden = rows === null || rows === undefined;
    if (!rows) return;
    document.getElementById("limits-empty").hidden = rows.length > 0;
    syncRows(document.querySelector("#limits tbody"), rows, (row) => `${row.kind}:${row.name}`, (row) => [
      row.kind === "group" ? `group ${row.name}` : row.name,
      row.kind === "group" ? row.members.join(", ") : "",
      ...LIMITED.map((key) => against(row, key)),
    ]);
  }

  function info(job) {
    if (job.reduced) return job.detached ? HIDDEN : "attached";
    const parts = [];
    if (job.error) parts.push(job.error);
    else if (job.exit_code !== null && job.exit_code !== undefined) parts.push(`exit ${job.exit_code}`);
    if (!job.detached) parts.unshift("attached");
    return parts.join("; ");
  }

  function renderJobs(jobs, limit) {
    const count = jobs.length >= limit ? `the newest ${limit}` : `${jobs.length}`;
    document.getElementById("jobs-count").textContent =
      `${count}: unfinished, and ended in the last day; newest first`;
    document.getElementById("jobs-empty").hidden = jobs.length > 0;
    syncRows(document.querySelector("#jobs tbody"), jobs, (job) => job.job_id, (job) => {
      const [waited, ran] = times(job);
      return [
        {text: job.job_id, href: jobHref(job.job_id), className: "id"},
        named(job),
        {text: job.state, className: `state state-${job.state}`},
        job.user,
        job.service,
        {text: job.reduced ? HIDDEN : job.what, className: "wide", title: job.reduced ? "" : job.what},
        need(job.ngpus, job.share_bytes),
        gpuList(job.gpus),
        when(job.submitted),
        waited,
        ran,
        {text: info(job), className: "wide", title: info(job)},
      ];
    });
  }

  poll("/api/host", EVERY, (data) => {
    const started = performance.now();
    clock.set(data.now);
    rpycdl.account(data);
    document.getElementById("host").textContent = data.host;
    document.title = `rpycdl: ${data.host}`;
    renderGpus(data.gpus);
    renderQueue(data.queue);
    renderLimits(data.limits);
    renderJobs(data.jobs, data.jobs_limit);
    rpycdl.renders = {count: (rpycdl.renders ? rpycdl.renders.count : 0) + 1, ms: performance.now() - started};
  });
})();
