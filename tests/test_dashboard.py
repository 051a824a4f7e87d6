"""The monitor's dashboard against real servers on simulated GPUs: in a real browser (headless Chromium driven
by selenium: a job goes from waiting to running to done without a reload, others' jobs reduced, its page follows
its log for its owner signed in with the site's secret; what an ended job used, for its owner; 8 GPUs, 100
waiting and 1000 jobs render quickly; a screenshot, $RPYCDL_SCREENSHOT), and its JSON API and log endpoint over
real HTTP (who asks, the log's bounds, untrusted text kept as data). tests/test_visibility.py has the monitor
with the team's client certificates."""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import os
import re
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from helpers import gate_job, open_gate, unavailable, wait_until

from rpycdl import JobState
from rpycdl.defaults import LOG_CHUNK, state_dir
from rpycdl.monitor.pages import HOST_REUSE
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.scheduler.queuedir import Need
from rpycdl.site.local import start
from rpycdl.units import GiB

REPO = Path(__file__).resolve().parent.parent
STATIC = REPO / "rpycdl" / "monitor" / "static"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's chromium and chromium-driver
SCREENSHOT_TO = "RPYCDL_SCREENSHOT"
"""Where the busy host's screenshot goes if set (docs/dashboard.png: docs/monitor.md's); a temporary file if not."""
SECRET = "correct horse battery staple"
HOSTILE = "<img src=x onerror=\"window.pwned=1\"><script>window.pwned=2</script><b>bold</b> & \u00e9"
"""Text a user controls (a command's arguments, an exception's message, a log): shown as it is, never run."""


CI_NEEDS = "run the browser tests (see .ci/run)"

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium at 1280x800, driven by selenium through Debian's chromedriver (nothing downloaded)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (pip install -e '.[test]')", CI_NEEDS)
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        unavailable(f"no {' nor '.join(missing)} (apt-get install -y chromium chromium-driver)", CI_NEEDS)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,800", "--hide-scrollbars"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    width, height = driver.execute_script("return [outerWidth - innerWidth, outerHeight - innerHeight]")
    driver.set_window_size(1280 + width, 800 + height)  # pages (and screenshots) of 1280x800
    yield driver
    driver.quit()


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return str(path)


@contextlib.contextmanager
def _monitor(lock_dir: str, gpus: str, *extra: str) -> Iterator[str]:
    """A monitor of `lock_dir` on a free port; its base URL."""
    process = start(["monitor", "--gpus", gpus, "--lock-dir", lock_dir, "--port", "0", *extra],
                    env={"RPYCDL_SECRET_FILE": ""})  # only what the test gives it
    try:
        yield "http://127.0.0.1:" + process.wait_for(r"on http://127\.0\.0\.1:(\d+)/metrics").group(1)
    finally:
        process.stop()


@pytest.fixture
def monitor(cluster, secret_file) -> Iterator[str]:
    """A monitor of the cluster's four simulated GPUs that shows logs for the secret; its base URL."""
    with _monitor(cluster.lock_dir, "fake:4", "--secret-file", secret_file) as base:
        yield base


@pytest.fixture
def blind_monitor(cluster) -> Iterator[str]:
    """A monitor without --secret-file."""
    with _monitor(cluster.lock_dir, "fake:2") as base:
        yield base


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Message, bytes]:
    """GET `url`: its status, headers (case-insensitive) and body, whatever the status."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def api(base: str, path: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, _, body = get(base + path, headers)
    assert status == 200, (path, status, body)
    return json.loads(body)


def bearer(secret: str = SECRET) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def basic(password: str, user: str = "anyone") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def holding() -> Callable[[tuple[str, int]], None]:
    """A job that uses `args[1]` bytes of its simulated GPU until the file `args[0]` exists (made here: a
    function of this module would travel by reference, and the job could not import it)."""

    def hold(args: tuple[str, int]) -> None:
        import os
        import time

        import rpycdl

        gate, size = args
        rpycdl.simulate_memory(size)
        while not os.path.exists(gate):
            time.sleep(0.01)

    return hold


def failing() -> Callable[[str], None]:
    """A job that raises ValueError(its argument)."""

    def fail(message: str) -> None:
        raise ValueError(message)

    return fail


# -- in a browser ------------------------------------------------------------------------------------------


def _text(driver: Any, selector: str) -> str:
    """The text of the first element `selector` finds ("" if none), read in the page at once."""
    return driver.execute_script("const n = document.querySelector(arguments[0]); return n ? n.textContent : ''",
                                 selector)


def _state(driver: Any, job_id: str) -> str:
    return _text(driver, f'#jobs tr[data-key="{job_id}"] td.state')


def _sign_in(driver: Any, user: str, secret: str = SECRET) -> None:
    """Sign in on the page shown, with a user name and the site's secret; wait for the page to say so."""
    wait_until(lambda: driver.find_element("id", "login").is_displayed(), 20, "the sign-in form")
    driver.find_element("id", "login-user").send_keys(user)
    driver.find_element("id", "login-secret").send_keys(secret)
    driver.find_element("id", "login-submit").click()
    wait_until(lambda: _text(driver, "#viewer") == f"you are {user} (unverified)", 20, f"{user} to be signed in")


def test_the_dashboard_follows_a_job_from_the_queue_to_its_end(cluster, connect, monitor, browser, tmp_path):
    port = cluster.add_server("pytorch", "fake:4")[1]
    alice, bob = connect(port), connect(port)
    alice.root.identify("alice")
    bob.root.identify("bob")
    gate, finish = str(tmp_path / "gate"), str(tmp_path / "finish")
    assert alice.root.submit(lambda x: x * 2, 21, name="warm-up").wait(20).state is JobState.SUCCEEDED
    failed = bob.root.submit(failing(), HOSTILE, gpu_memory="2GiB")
    assert failed.wait(20).state is JobState.FAILED
    holder = alice.root.submit(gate_job(gate), 1, ngpus=2, name="pretrain")
    shares = [bob.root.submit(holding(), (gate, used), gpu_memory=asked, name=name)
              for used, asked, name in ((3 * GiB, "4GiB", "eval-a"), (5 * GiB, "6GiB", "eval-b"))]
    for job in (holder, *shares):
        wait_until(lambda job=job: job.status().state is JobState.RUNNING, 20, "the first jobs to run")
    script = (f"echo first line {shlex.quote(HOSTILE)}; while [ ! -e {shlex.quote(finish)} ]; do sleep 0.05; done; "
              "echo second line")
    watched = alice.root.submit_command(["sh", "-c", script, "finetune"], ngpus=3, name="finetune")
    behind = bob.root.submit(gate_job(gate), 2, gpu_memory="8GiB", name="sweep-7")
    wait_until(lambda: behind.status().queued == 1, 20, "two requests to wait")

    def queue() -> list[list[str]]:
        return [row[:7] for row in browser.execute_script(
            "return [...document.querySelectorAll('#queue tbody tr')].map(r => [...r.cells].map(c => c.textContent))")]

    browser.get(monitor + "/")  # nobody signed in: every job, reduced
    wait_until(lambda: _state(browser, watched.id) == "PENDING" and _state(browser, behind.id) == "PENDING", 20,
               "the dashboard to show the waiting jobs")
    assert [row[2] for row in queue()] == ["-", "-"] and _text(browser, "#viewer") == ""
    assert HOSTILE not in _text(browser, "main") and "warm-up" not in _text(browser, "main")
    _sign_in(browser, "bob")  # bob's own jobs in full, alice's reduced
    wait_until(lambda: _state(browser, behind.id) == "PENDING", 20, "the dashboard again")
    assert queue() == [["1", watched.id, "-", "alice (unverified)", "pytorch", "3 GPUs", "0, 1, 2, 3"],
                       ["2", behind.id, "sweep-7", "bob (unverified)", "pytorch", "8 GiB of one GPU", "0, 1, 2, 3"]]
    cards = browser.execute_script("return [...document.querySelectorAll('.gpu')].map(g => g.textContent)")
    assert len(cards) == 4
    held = "".join(cards)
    assert holder.id in held and "pretrain" not in held and all(share.id in held for share in shares)
    assert "eval-a" in held and "eval-b" in held
    assert "granted 10 GiB of 16 GiB · used 8 GiB" in held and "free" in cards[3]
    assert _state(browser, failed.id) == "FAILED" and "warm-up" not in _text(browser, "#jobs tbody")
    # untrusted text is shown as it is, and nothing of it runs; alice's command is not bob's to read
    assert HOSTILE in _text(browser, f'#jobs tr[data-key="{failed.id}"]')
    assert HOSTILE not in _text(browser, f'#jobs tr[data-key="{watched.id}"]')
    assert "finetune" not in _text(browser, "main")
    assert browser.execute_script("return [window.pwned, document.querySelectorAll('main img, main b, main script')"
                                  ".length]") == [None, 0]
    screenshot = Path(os.environ.get(SCREENSHOT_TO) or tmp_path / "dashboard.png")
    assert browser.save_screenshot(str(screenshot)) and screenshot.read_bytes().startswith(b"\x89PNG")
    browser.execute_script("window.sameLoad = true")  # gone if the page were loaded again

    open_gate(gate)
    wait_until(lambda: _state(browser, watched.id) == "RUNNING", 20, "the dashboard to show the job running")
    assert browser.execute_script("return window.sameLoad") is True
    href = browser.execute_script(f"return document.querySelector('#jobs tr[data-key=\"{watched.id}\"] a')"
                                  ".getAttribute('href')")
    assert href == f"/jobs/{watched.id}"

    dashboard = browser.current_window_handle
    browser.switch_to.new_window("tab")
    browser.get(monitor + href)  # a tab of its own: nobody signed in
    wait_until(lambda: _text(browser, "#job-state") == "RUNNING", 20, "the job's page")
    assert _text(browser, "#job-command") == "" and "only its owner" in _text(browser, "#job-reduced")
    assert "sign in" in _text(browser, "#log-message") and not browser.find_element("id", "log").is_displayed()
    _sign_in(browser, "bob")
    wait_until(lambda: "you are bob (unverified)" in _text(browser, "#log-message"), 20, "the log refused to bob")
    assert _text(browser, "#job-command") == "" and not browser.find_element("id", "log").is_displayed()
    browser.find_element("id", "logout").click()
    _sign_in(browser, "alice")
    wait_until(lambda: _text(browser, "#job-command") == shlex.join(["sh", "-c", script, "finetune"]), 20,
               "her job's command, for her")
    wait_until(lambda: "first line" in _text(browser, "#log"), 20, "the log's first line")
    assert _text(browser, "#log") == f"first line {HOSTILE}\n"
    open_gate(finish)
    wait_until(lambda: "second line" in _text(browser, "#log"), 20, "the log's next line, live")
    wait_until(lambda: _text(browser, "#job-state") == "SUCCEEDED", 20, "the job's page to show its end")
    wait_until(lambda: browser.execute_script("return document.getElementById('log').dataset.complete"), 10,
               "the whole log")
    assert _text(browser, "#log") == f"first line {HOSTILE}\nsecond line\n"
    assert _text(browser, "#job-exit-code") == "0"
    assert browser.execute_script("return [window.pwned, document.querySelectorAll('main img, main b').length]") \
        == [None, 0]

    browser.close()
    browser.switch_to.window(dashboard)
    wait_until(lambda: _state(browser, watched.id) == "SUCCEEDED", 20, "the dashboard to show the job done")
    assert browser.execute_script("return window.sameLoad") is True
    status, _, body = get(f"{monitor}/api/jobs/{watched.id}/log")
    assert status == 401 and b"secret" in body  # the browser had it; the API gives nothing without it


def test_the_dashboard_renders_8_gpus_100_waiting_and_1000_jobs_quickly(lock_dir, browser):
    uuids = [f"GPU-00000000-0000-4000-8000-{index:012d}" for index in range(8)]
    sizes = dict.fromkeys(uuids, 16 * GiB)
    locks = GPULockManager(lock_dir)
    grant = locks.acquire(Need(8, tuple(uuids), 0, sizes), {"job_id": "holder0all8", "user": "alice",
                                                             "server": "pytorch"})
    places = [locks.enqueue(Need(1 + index % 8, tuple(uuids), 0, sizes),
                            {"job_id": f"wait{index:08d}", "user": f"user{index % 7}", "server": "pytorch"})
              for index in range(100)]
    ledger, now = Ledger(state_dir(lock_dir)), time.time()
    for index in range(1000):
        ledger.save(JobRecord(job_id=f"done{index:08d}", server_id="s", client="127.0.0.1:1", ngpus=1,
                              state=JobState.FAILED if index % 10 == 0 else JobState.SUCCEEDED,
                              submitted=now - 3600 + index, started=now - 3590 + index, ended=now - 3000 + index,
                              user=f"user{index % 7}", service="pytorch", detached=True, kind="command",
                              request={"command": ["python", "train.py", f"--seed={index}"]},
                              error=HOSTILE if index % 10 == 0 else ""))
    try:
        with _monitor(lock_dir, "fake:8") as base:
            started = time.monotonic()
            status, headers, body = get(base + "/api/host", {"Accept-Encoding": "gzip"})
            assert status == 200 and headers.get("Content-Encoding") == "gzip", (status, headers, body[:2000])
            answered = time.monotonic() - started
            browser.get(base + "/")
            wait_until(lambda: browser.execute_script(
                "return document.querySelectorAll('#jobs tbody tr').length === 1000 && "
                "document.querySelectorAll('#queue tbody tr').length === 100 && "
                "document.querySelectorAll('.gpu').length === 8"), 20, "every row")
            first = browser.execute_script("return rpycdl.renders")
            wait_until(lambda: browser.execute_script("return rpycdl.renders.count") >= first["count"] + 2, 10,
                       "two more updates")
            again = browser.execute_script("return rpycdl.renders")
            assert answered < 2 and first["ms"] < 1000 and again["ms"] < 250, (answered, first, again, len(body))
            assert _text(browser, "#jobs-count").startswith("the newest 1000")
            assert browser.execute_script("return window.pwned") is None
    finally:
        for place in places:
            os.close(place.fifo_fd)
        locks.release(grant)


def test_a_jobs_page_shows_its_owner_what_it_used(lock_dir, browser, secret_file):
    ledger, now = Ledger(state_dir(lock_dir)), time.time()
    rows = {job_id: JobRecord(job_id=job_id, server_id="s", client="127.0.0.1:1", ngpus=1, state=JobState.SUCCEEDED,
                              submitted=now - 100, started=now - 90, ended=now, user="alice", service="pytorch",
                              detached=True, kind="command", **used)
            for job_id, used in (("measured0001", {"peak_memory": 3 * GiB, "cpu_seconds": 3725.2, "max_procs": 17}),
                                 ("unmeasured01", {}))}
    for record in rows.values():
        ledger.save(record)
    with _monitor(lock_dir, "fake:2", "--secret-file", secret_file) as base:
        browser.get(base + "/jobs/measured0001")
        wait_until(lambda: _text(browser, "#job-state") == "SUCCEEDED", 20, "the job's page")
        assert _text(browser, "#job-peak-memory") == ""  # nobody signed in: not theirs to see
        _sign_in(browser, "alice")
        wait_until(lambda: _text(browser, "#job-peak-memory") == "3 GiB", 20, "what her job used")
        assert (_text(browser, "#job-cpu"), _text(browser, "#job-max-procs")) == ("1h02m", "17 at most at once")
        browser.get(base + "/jobs/unmeasured01")  # signed in still (this tab's session)
        wait_until(lambda: "alice" in _text(browser, "#viewer") and _text(browser, "#job-state") == "SUCCEEDED", 20,
                   "the other job's page")
        assert "peak memory" not in _text(browser, "#details") and "CPU time" not in _text(browser, "#details")


# -- over HTTP ---------------------------------------------------------------------------------------------


def test_the_log_needs_its_owner_with_the_secret(cluster, connect, monitor):
    conn = connect(cluster.add_server("pytorch", "fake:4")[1])
    conn.root.identify("alice")
    job = conn.root.submit_command(["echo", "hello"], ngpus=1)
    assert job.wait(20).state is JobState.SUCCEEDED
    url = f"{monitor}/api/jobs/{job.id}/log"
    status, headers, body = get(url)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ") and b"secret" in body
    for wrong in (bearer("not the secret at all"), basic("not the secret at all", "alice"), bearer(SECRET[:-1]),
                  bearer(SECRET + "x")):
        assert get(url, wrong)[:1] == (403,), wrong
    for malformed in ({"Authorization": "Basic !!!"}, {"Authorization": "Basic " + base64.b64encode(b"x").decode()},
                      {"Authorization": "Digest x"}, {"Authorization": "Bearer "}, basic(SECRET, "not a name")):
        assert get(url, malformed)[0] == 401, malformed
    for other in (bearer(), basic(SECRET), basic(SECRET, user=""), basic(SECRET, "bob")):  # the secret, not her name
        status, _, body = get(url, other)
        assert status == 403 and b"belongs to alice (unverified)" in body, other
    status, headers, body = get(url, basic(SECRET, "alice"))
    assert (status, body) == (200, b"hello\n")
    assert (headers["X-Next-Offset"], headers["X-Log-Size"], headers["X-Job-State"]) == ("6", "6", "SUCCEEDED")
    assert headers["Content-Type"] == "text/plain; charset=utf-8" and headers["X-Content-Type-Options"] == "nosniff"
    row = api(monitor, f"/api/jobs/{job.id}", basic(SECRET, "alice"))
    assert row["logs"] is True and row["viewer"] == "alice (unverified)" and row["job"]["log_size"] == 6
    # what anyone may see, as `rpycdl jobs` shows it: that the job exists, not its command nor its log
    row = api(monitor, f"/api/jobs/{job.id}")
    assert row["logs"] is False and row["viewer"] is None and row["secret"] is True
    assert row["job"]["state"] == "SUCCEEDED" and row["job"]["reduced"] is True
    assert "what" not in row["job"] and "request" not in row["job"] and "log_size" not in row["job"]


def test_without_a_secret_file_no_log_is_shown(cluster, connect, blind_monitor):
    conn = connect(cluster.add_server("pytorch", "fake:2")[1])
    job = conn.root.submit_command(["echo", "hello"], ngpus=1)
    assert job.wait(20).state is JobState.SUCCEEDED
    for headers in ({}, bearer(), basic(SECRET)):
        status, _, body = get(f"{blind_monitor}/api/jobs/{job.id}/log", headers)
        assert status == 403 and b"--secret-file" in body and b"rpycdl logs" in body
    assert api(blind_monitor, f"/api/jobs/{job.id}")["logs"] is False
    assert api(blind_monitor, f"/api/jobs/{job.id}")["secret"] is False


def test_the_log_is_read_in_bounded_pieces(cluster, connect, monitor):
    conn = connect(cluster.add_server("pytorch", "fake:4")[1])

    def talk(lines: int) -> None:
        for index in range(lines):
            print(f"line {index:07d} \u00e9\u6f22 " + "x" * 80, flush=False)

    job = conn.root.submit(talk, 30_000, ngpus=1)
    assert job.wait(30).state is JobState.SUCCEEDED
    owner = basic(SECRET, conn.identity["user"])
    expected = "".join(f"line {index:07d} \u00e9\u6f22 " + "x" * 80 + "\n" for index in range(30_000)).encode()
    assert len(expected) > 2 * LOG_CHUNK

    def piece(offset: Any, **query: Any) -> tuple[int, Message, bytes]:
        extra = "".join(f"&{key}={value}" for key, value in query.items())
        return get(f"{monitor}/api/jobs/{job.id}/log?offset={offset}{extra}", owner)

    read, offset = b"", 0
    while True:
        status, headers, body = piece(offset)
        assert status == 200 and len(body) <= LOG_CHUNK and int(headers["X-Log-Size"]) == len(expected)
        if not body:
            break
        read += body
        offset = int(headers["X-Next-Offset"])
        assert offset == len(read)
    assert read == expected  # whole, however the pieces cut its characters
    assert len(piece(0)[2]) == LOG_CHUNK and len(piece(0, size=10**12)[2]) == LOG_CHUNK  # at most 1 MiB a call
    status, headers, body = piece(5, size=10)
    assert body == expected[5:15] and headers["X-Next-Offset"] == "15"
    for past in (len(expected), len(expected) + 1, 2**40):  # past the end: nothing, and the end as next
        status, headers, body = piece(past)
        assert (status, body, headers["X-Next-Offset"]) == (200, b"", str(len(expected))), past
    for bad in ("-1", "abc", "1e3", str(2**60), ""):
        assert piece(bad)[0] == 400, bad
    assert piece(0, size=-1)[0] == 400
    assert conn.root.run_code(lambda x: x, 1) == 1
    attached_id = Ledger(state_dir(cluster.lock_dir)).query(limit=1)[0].job_id
    for job_id in (attached_id, "nosuchjob", "a.b", "x" * 65, "%2e%2e"):
        assert get(f"{monitor}/api/jobs/{job_id}/log", owner)[0] == 404, job_id
        assert get(f"{monitor}/api/jobs/{job_id}")[0] == (200 if job_id == attached_id else 404), job_id


def test_untrusted_text_is_data_and_the_pages_are_static(cluster, connect, monitor, tmp_path):
    conn = connect(cluster.add_server("pytorch", "fake:4")[1])
    conn.root.identify("mallory")
    gate = str(tmp_path / "gate")
    failed = conn.root.submit(failing(), HOSTILE, ngpus=1)
    assert failed.wait(20).state is JobState.FAILED
    running = conn.root.submit_command(["sh", "-c", f"until [ -e {shlex.quote(gate)} ]; do sleep 0.05; done",
                                        HOSTILE], ngpus=1)
    wait_until(lambda: running.status().state is JobState.RUNNING, 20, "the command to run")
    mallory = basic(SECRET, "mallory")
    host = api(monitor, "/api/host", mallory)
    rows = {row["job_id"]: row for row in host["jobs"]}
    assert HOSTILE in rows[failed.id]["error"] and rows[running.id]["what"].endswith(shlex.quote(HOSTILE))
    assert api(monitor, f"/api/jobs/{running.id}", mallory)["job"]["request"]["command"][-1] == HOSTILE
    pages = {}
    for path in ("/", f"/jobs/{failed.id}", f"/jobs/{running.id}", "/jobs/<script>"):
        status, headers, body = get(monitor + path)
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8", path
        assert "script-src 'self'" in headers["Content-Security-Policy"] and "default-src 'none'" in \
            headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
        pages[path] = body
    assert pages["/"] == (STATIC / "index.html").read_bytes()  # the same bytes whatever the jobs: no data in them
    assert len({pages[path] for path in pages if path != "/"}) == 1
    for name in ("common.js", "dashboard.js", "job.js", "dashboard.css", "favicon.svg"):
        status, headers, body = get(f"{monitor}/static/{name}")
        assert status == 200 and body == (STATIC / name).read_bytes(), name
    assert get(f"{monitor}/static/nothing.js")[0] == 404
    assert get(f"{monitor}/static/..%2fhost.py")[0] == 404
    for script in STATIC.glob("*.js"):  # data enters the DOM as text only
        source = script.read_text()
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function",
                             source), script.name
    for html in STATIC.glob("*.html"):
        assert not re.search(r"<script>|\son\w+=|style=|https?://", html.read_text()), html.name
    open_gate(gate)
    assert running.wait(20).state is JobState.SUCCEEDED


def test_the_host_api_shows_holders_and_the_queue_in_order(cluster, connect, monitor, tmp_path):
    conn = connect(cluster.add_server("pytorch", "fake:4")[1])
    conn.root.identify("alice")
    gate = str(tmp_path / "gate")
    whole = conn.root.submit(gate_job(gate), 1, ngpus=1, name="whole")
    wait_until(lambda: whole.status().state is JobState.RUNNING, 20, "the whole-GPU job to run")
    share = conn.root.submit(holding(), (gate, 3 * GiB), gpu_memory="4GiB")
    wait_until(lambda: share.status().state is JobState.RUNNING, 20, "the share to run")
    waiting = [conn.root.submit(gate_job(gate), index, ngpus=4) for index in range(2)]
    wait_until(lambda: waiting[1].status().queued == 1, 20, "two requests to wait")
    alice = basic(SECRET, "alice")

    def asked_twice_within_reuse() -> tuple[int, Any, bytes, dict[str, Any]] | None:
        """A fresh answer (gzipped), and the same asked again, if both came back within HOST_REUSE of the first
        asking: the second must then reuse the first (on a busy machine a pair may take longer: ask again)."""
        time.sleep(HOST_REUSE * 1.1)  # past the answer the monitor may reuse
        asked = time.monotonic()
        status, headers, body = get(monitor + "/api/host", {"Accept-Encoding": "gzip", **alice})
        again = api(monitor, "/api/host", alice)
        return (status, headers, body, again) if time.monotonic() - asked < HOST_REUSE else None

    status, headers, body, again = wait_until(asked_twice_within_reuse, 60, "two answers within a second")
    assert status == 200 and headers["Content-Encoding"] == "gzip" and headers["Vary"] == "Accept-Encoding"
    host = json.loads(gzip.decompress(body))
    assert host == again  # the same answer, reused within a second
    assert host["viewer"] == "alice (unverified)" and host["secret"] is True
    anyone = api(monitor, "/api/host")  # nobody signed in: the same jobs and holders, without their names
    assert [row["job_id"] for row in anyone["jobs"]] == [row["job_id"] for row in host["jobs"]]
    assert all(row["reduced"] and "name" not in row for row in anyone["jobs"]) and anyone["viewer"] is None
    assert abs(host["now"] - time.time()) < 5 and host["jobs_limit"] == 1000
    gpus = {gpu["index"]: gpu for gpu in host["gpus"]}
    assert sorted(gpus) == [0, 1, 2, 3] and all(gpu["memory_total"] == 16 * GiB for gpu in gpus.values())
    holders = {holder["job_id"]: (index, holder) for index, gpu in gpus.items() for holder in gpu["holders"]}
    assert set(holders) == {whole.id, share.id}
    at, holder = holders[whole.id]
    assert holder["kind"] == "whole" and holder["name"] == "whole" and holder["user"] == "alice (unverified)"
    assert gpus[at]["memory_granted"] == 16 * GiB and holder["service"] == "pytorch" and not holder["leftover"]
    at, holder = holders[share.id]
    assert holder["kind"] == "share" and holder["share_bytes"] == 4 * GiB
    assert gpus[at]["memory_granted"] == 4 * GiB and gpus[at]["memory_used"] == 3 * GiB
    assert [(entry["position"], entry["job_id"], entry["ngpus"], entry["share_bytes"], entry["gpus"])
            for entry in host["queue"]] == [(1, waiting[0].id, 4, 0, list(gpus)), (2, waiting[1].id, 4, 0, list(gpus))]
    assert all(time.time() - 30 < entry["since"] <= time.time() for entry in host["queue"])
    assert [row["job_id"] for row in host["jobs"]] == [waiting[1].id, waiting[0].id, share.id, whole.id]  # newest first
    assert [row["state"] for row in host["jobs"]] == ["PENDING", "PENDING", "RUNNING", "RUNNING"]
    row = api(monitor, f"/api/jobs/{waiting[1].id}", alice)["job"]
    assert row["position"] == 2 and row["state"] == "PENDING" and row["what"] == "a function"
    open_gate(gate)
    for job in (whole, share, *waiting):
        assert job.wait(20).state is JobState.SUCCEEDED
