//! The web console (`GET /`) in a real browser: headless Chromium driven over WebDriver
//! (chromedriver), against the whole system in embedded mode with real runner processes.
//!
//! One browser session walks through what a user does: sign in (a wrong key first: the
//! API's error code is shown), chat with an agent and watch the reply stream in (at least two
//! growing partial states), stop a slow reply, see a knowledge retrieval and its citations as
//! collapsed cards, page through the runs and filter them by status, open a run and see its
//! items, watch a live run's items arrive across a dropped connection (a proxy in front of
//! the gateway cuts it; no gap, no duplicate) and cancel it from its page, create an agent (a
//! refused one first), create, edit and delete a knowledge base, visit every other page, and
//! check the chat on a phone-sized window. A PNG screenshot of each page is written to
//! `target/console-screenshots/`.
//!
//! Chromium and chromedriver come from Debian's `chromium` and `chromium-driver` packages
//! (`scripts/test` installs them); `SWITCHBOARD_CHROMIUM` and `SWITCHBOARD_CHROMEDRIVER`
//! point elsewhere. Without them the test is skipped, unless
//! `SWITCHBOARD_TEST_REQUIRE_SERVICES=1`, where it fails.
//!
//! Waits are explicit: every step polls the page for the state it expects (a JavaScript
//! predicate) until a deadline, never a fixed sleep.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fantoccini::wd::Capabilities;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use sb_tests::{TEST_SHARED, TestCluster, target_dir};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long one step may take to show what it waits for.
const STEP: Duration = Duration::from_secs(20);
/// A script expression: `main` shows the current address and is done rendering (the
/// console records the route a render showed in `main[data-route]` when it ends, so a page
/// changed by a button is not mistaken for the one before it).
const RENDERED: &str = "(document.querySelector('main').dataset.route === location.hash \
     && !document.querySelector('main').hasAttribute('aria-busy'))";

/// Chromium and its driver, when installed.
fn browser_binaries() -> Option<(PathBuf, PathBuf)> {
    let pick = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(default))
    };
    let chromium = pick("SWITCHBOARD_CHROMIUM", "/usr/bin/chromium");
    let driver = pick("SWITCHBOARD_CHROMEDRIVER", "/usr/bin/chromedriver");
    (chromium.is_file() && driver.is_file()).then_some((chromium, driver))
}

/// A chromedriver process and its WebDriver session. The driver runs in a process group of
/// its own, which the Chromium it starts joins; dropping the browser kills the whole group,
/// so a test that panics before closing its session leaves no Chromium behind (killing only
/// the driver would orphan it, still running, for the rest of the suite).
struct Browser {
    client: Client,
    _driver: Child,
    driver_group: Option<nix::unistd::Pid>,
    _profile: tempfile::TempDir,
    screenshots: PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(group) = self.driver_group {
            // ESRCH (the group already gone) is what a closed session leaves: nothing to do.
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

impl Browser {
    /// Starts chromedriver on a free port and opens a headless Chromium session, or `None`
    /// (test skipped) when they are not installed and services are not required.
    async fn start() -> Option<Self> {
        let Some((chromium, driver)) = browser_binaries() else {
            assert!(
                std::env::var("SWITCHBOARD_TEST_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "chromium and chromedriver are required (apt-get install chromium chromium-driver; \
                 scripts/test installs them)"
            );
            eprintln!("skipped: chromium or chromedriver is not installed");
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let driver = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .process_group(0)
            .spawn()
            .expect("chromedriver starts");
        let driver_group = driver
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(nix::unistd::Pid::from_raw);
        let profile = tempfile::tempdir().expect("a profile directory");
        let mut capabilities = Capabilities::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium,
                "args": [
                    "--headless=new",
                    // Tests run as root, where Chromium's sandbox cannot start.
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--window-size=1280,900",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + STEP;
        let client = loop {
            match ClientBuilder::new(HttpConnector::new())
                .capabilities(capabilities.clone())
                .connect(&url)
                .await
            {
                Ok(client) => break client,
                Err(error) if Instant::now() < deadline => {
                    tracing::debug!(%error, "chromedriver not ready yet");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("no WebDriver session: {error}"),
            }
        };
        let screenshots = target_dir()
            .parent()
            .expect("target/<profile> has a parent")
            .join("console-screenshots");
        std::fs::create_dir_all(&screenshots).expect("the screenshot directory");
        Some(Self {
            client,
            _driver: driver,
            driver_group,
            _profile: profile,
            screenshots,
        })
    }

    /// Polls `predicate` (a JavaScript function body returning a value) until it returns
    /// something truthy, which it returns; panics with `what` and the last value after
    /// [`STEP`].
    async fn wait_for(&self, what: &str, predicate: &str) -> Value {
        let deadline = Instant::now() + STEP;
        loop {
            let value = self
                .client
                .execute(predicate, vec![])
                .await
                .unwrap_or_else(|e| panic!("{what}: script failed: {e}"));
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Array(a) => !a.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return value;
            }
            if Instant::now() > deadline {
                let page = self.text("main").await;
                panic!("timed out waiting for {what} (last: {value}); the page says:\n{page}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The text of the first element matching `css` ("" when none).
    async fn text(&self, css: &str) -> String {
        match self.client.find(Locator::Css(css)).await {
            Ok(el) => el.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    async fn find(&self, css: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(STEP)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no element {css}: {e}"))
    }

    async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("cannot click {css}: {e}"));
    }

    async fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css).await;
        el.clear().await.expect("clear");
        el.send_keys(text)
            .await
            .unwrap_or_else(|e| panic!("cannot type into {css}: {e}"));
    }

    async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("cannot open {url}: {e}"));
    }

    /// Waits until page `name` has rendered for the current address (`main[data-page]`,
    /// `main[data-route]` the address's, not busy).
    async fn page_ready(&self, name: &str) {
        self.wait_for(
            &format!("page {name}"),
            &format!(
                "const m = document.querySelector('main'); \
                 return m.dataset.page === '{name}' && {RENDERED} \
                 && m.querySelector('h2') !== null;"
            ),
        )
        .await;
    }

    async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("a screenshot");
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        write(&self.screenshots.join(format!("{name}.png")), &png);
    }
}

/// A TCP proxy in front of the gateway that can cut every open connection, as a network
/// failure would: the browser talks to the gateway through it.
struct Proxy {
    addr: std::net::SocketAddr,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    accepted: Arc<AtomicUsize>,
    _accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: &str) -> Self {
        let upstream: std::net::SocketAddr = upstream
            .trim_start_matches("http://")
            .parse()
            .expect("the gateway's address");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the proxy binds");
        let addr = listener.local_addr().expect("the proxy's address");
        let connections = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let accept = tokio::spawn({
            let connections = Arc::clone(&connections);
            let accepted = Arc::clone(&accepted);
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let task = tokio::spawn(async move {
                        if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    connections.lock().unwrap().push(task.abort_handle());
                }
            }
        });
        Self {
            addr,
            connections,
            accepted,
            _accept: accept,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops every open connection (both ends see them closed).
    fn cut(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_works_in_a_real_browser() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let cluster = TestCluster::embedded().await;
    let api = cluster.client();
    let proxy = Proxy::start(api.base_url()).await;
    let base = proxy.url();
    // The scripted test runner behind an agent that no event reaches by its scope (the
    // workspace-wide echo agent answers the rest); a chat session reaches it by id.
    let scripted = api.conversation_agent("console-scripts", TEST_SHARED).await;

    // Sign in: a wrong key shows the API's error code, the right one opens the chat.
    browser.goto(&format!("{base}/")).await;
    browser.find("input[name=api_key]").await;
    browser.screenshot("sign-in").await;
    browser.type_into("input[name=api_key]", "sk-wrong").await;
    browser.click("form.sign-in button[type=submit]").await;
    let error = browser
        .wait_for(
            "the refused key's error",
            "const e = document.getElementById('error'); return !e.hidden && e.textContent;",
        )
        .await;
    assert!(error.as_str().unwrap().contains("unauthorized"), "{error}");
    let key = cluster
        .process()
        .api_key()
        .expect("the bootstrap created a key")
        .to_owned();
    browser.type_into("input[name=api_key]", &key).await;
    browser.click("form.sign-in button[type=submit]").await;
    browser.page_ready("chat").await;
    let stored = browser
        .client
        .execute(
            "return sessionStorage.getItem('switchboard.api_key');",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(stored, json!(key), "the key is kept in the tab's session");
    let local = browser
        .client
        .execute("return localStorage.length;", vec![])
        .await
        .unwrap();
    assert_eq!(local, json!(0), "nothing in localStorage");

    // Chat: the reply streams in (several partial states are seen), then settles.
    browser
        .find("select[name=agent]")
        .await
        .select_by_value(&scripted)
        .await
        .expect("the scripted agent is offered");
    browser
        .type_into("textarea[name=message]", "slow 400")
        .await;
    browser.click("form.composer button[type=submit]").await;
    let mut partial = Vec::<String>::new();
    let deadline = Instant::now() + STEP;
    let last = loop {
        let state = browser
            .client
            .execute(
                "const r = [...document.querySelectorAll('.msg.assistant')].pop(); \
                 if (!r) return null; \
                 return {text: r.querySelector('.msg-text')?.textContent ?? '', \
                         status: r.querySelector('.msg-status').textContent};",
                vec![],
            )
            .await
            .expect("read the reply");
        if let Some(text) = state["text"].as_str() {
            if state["status"] == "completed" {
                break text.to_owned();
            }
            // Until `run.completed`, the text is partial; the settled message (`slow 400`,
            // from `message.completed`) may be seen just before it.
            let settled = text == "slow 400";
            if !text.is_empty() && !settled && partial.last().map(String::as_str) != Some(text) {
                partial.push(text.to_owned());
            }
        }
        assert!(
            Instant::now() < deadline,
            "the reply never completed: {state}"
        );
    };
    assert_eq!(last, "slow 400", "the final message replaces the deltas");
    eprintln!(
        "partial states of the streamed reply seen: {}",
        partial.len()
    );
    assert!(
        partial.len() >= 2,
        "at least two partial states of the streamed reply: {partial:?}"
    );
    for (earlier, later) in partial.iter().zip(partial.iter().skip(1)) {
        assert!(
            later.starts_with(earlier.as_str()) && later.len() > earlier.len(),
            "the reply grows: {earlier:?} then {later:?}"
        );
        assert!(later.starts_with("0 1 2"), "deltas in order: {later:?}");
    }
    let live = browser
        .client
        .execute(
            "return document.querySelector('.chat-log').getAttribute('aria-live');",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(live, json!("polite"), "streamed text is announced");
    browser.screenshot("chat").await;

    // Stop: a reply that waits for a cancel ends as cancelled.
    browser
        .wait_for(
            "the composer ready again",
            "return !document.querySelector('form.composer button[type=submit]').disabled;",
        )
        .await;
    browser
        .type_into("textarea[name=message]", "cancellable")
        .await;
    browser.click("form.composer button[type=submit]").await;
    browser
        .wait_for(
            "the slow reply's first delta",
            "const r = [...document.querySelectorAll('.msg.assistant')].pop(); \
             return r && r.querySelector('.msg-text')?.textContent === 'waiting for cancel';",
        )
        .await;
    browser.click("form.composer button.danger").await;
    browser
        .wait_for(
            "the cancelled reply",
            "const r = [...document.querySelectorAll('.msg.assistant')].pop(); \
             return r.querySelector('.msg-status').textContent.includes('cancelled');",
        )
        .await;
    let cancelled_run = browser
        .client
        .execute(
            "return [...document.querySelectorAll('.msg.assistant')].pop().dataset.runId;",
            vec![],
        )
        .await
        .unwrap();
    let cancelled_run = cancelled_run
        .as_str()
        .expect("the reply's run id")
        .to_owned();
    let run = api
        .get(&format!("/v1/runs/{cancelled_run}"))
        .await
        .expect(200);
    assert_eq!(run.body["status"], "cancelled", "{}", run.body);
    browser.screenshot("chat-stopped").await;

    // A knowledge retrieval and its citations: collapsible cards beside the answer.
    let results = json!([
        {"type": "tool.call.started", "data": {"tool_call_id": "c1", "tool_name": "retrieve_knowledge",
            "parameters": {"query": "holidays"}}},
        {"type": "tool.call.completed", "data": {"tool_call_id": "c1", "tool_name": "retrieve_knowledge",
            "result": {"chunks": 1},
            "citations": [{"title": "Handbook", "text": "25 days a year", "score": 0.9}]}},
        {"type": "message.completed", "data": {"message": {"role": "assistant", "content": "25 days [1]."}}},
        {"type": "run.completed", "data": {"finish_reason": "stop"}},
    ]);
    browser
        .wait_for(
            "the composer ready again",
            "return !document.querySelector('form.composer button[type=submit]').disabled;",
        )
        .await;
    // The run is created and ends between the stream's first 404 and the turn snapshot that
    // follows it (a busy host, a fast runner): the browser's first stream request is answered
    // 404 only once the run has completed, and the reply must still show it.
    browser
        .client
        .execute(
            "const real = window.fetch; window.__sbRealFetch = real; window.__sbLateRuns = 0; \
             window.fetch = async (input, init) => { \
               const m = String(input).match(/\\/v1\\/runs\\/([^/?]+)\\/stream/); \
               if (!m || window.__sbLateRuns > 0) return real(input, init); \
               window.__sbLateRuns++; \
               for (;;) { \
                 const r = await real(`/v1/runs/${m[1]}`, { headers: init.headers }); \
                 if (r.ok && (await r.json()).status === 'completed') break; \
                 await new Promise((ok) => setTimeout(ok, 20)); \
               } \
               return new Response(JSON.stringify({code: 'not_found', message: 'no such run'}), \
                 {status: 404, headers: {'content-type': 'application/json'}}); \
             };",
            vec![],
        )
        .await
        .expect("the late-run fetch is installed");
    browser
        .type_into("textarea[name=message]", &format!("raw {results}"))
        .await;
    browser.click("form.composer button[type=submit]").await;
    let cards = browser
        .wait_for(
            "the knowledge cards",
            "const r = [...document.querySelectorAll('.msg.assistant')].pop(); \
             if (r.querySelector('.msg-status').textContent !== 'completed') return null; \
             return [...r.querySelectorAll('details.card')].map((d) => \
                 [d.className, d.querySelector('summary').textContent, d.open]);",
        )
        .await;
    assert_eq!(
        cards,
        json!([
            [
                "card card-knowledge",
                "Knowledge: retrieve_knowledge done",
                false
            ],
            ["card card-citations", "Sources (1)", false],
        ]),
        "collapsed cards"
    );
    let late = browser
        .client
        .execute(
            "window.fetch = window.__sbRealFetch; return window.__sbLateRuns;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(late, json!(1), "the reply's stream was first answered 404");
    browser
        .click(".msg.assistant:last-of-type details.card-citations > summary")
        .await;
    let source = browser
        .wait_for(
            "the open citation",
            "const d = [...document.querySelectorAll('details.card-citations')].pop(); \
             return d.open && d.querySelector('li').textContent;",
        )
        .await;
    assert!(
        source.as_str().unwrap().contains("25 days a year"),
        "{source}"
    );
    browser.screenshot("chat-knowledge").await;

    // Runs: filtered by status, the cancelled run is the only one; its page shows its items.
    browser.goto(&format!("{base}/#/runs")).await;
    browser.page_ready("runs").await;
    browser
        .wait_for(
            "both chat runs in the list",
            "return document.querySelectorAll('tbody tr').length >= 2;",
        )
        .await;
    browser.screenshot("runs").await;
    // Paging: two runs a page; Older, then Newer back to the first page.
    browser.goto(&format!("{base}/#/runs?limit=2")).await;
    let first = browser
        .wait_for(
            "a page of two runs",
            "const rows = [...document.querySelectorAll('tbody tr')]; \
             return rows.length === 2 && location.hash.includes('limit=2') && rows.map((r) => r.dataset.runId);",
        )
        .await;
    browser.click("nav.pager button:nth-child(2)").await;
    let second = browser
        .wait_for(
            "the older page",
            &format!(
                "if (!location.hash.includes('cursor=')) return null; \
                 const rows = [...document.querySelectorAll('tbody tr')]; \
                 return {RENDERED} && rows.length > 0 && rows.map((r) => r.dataset.runId);"
            ),
        )
        .await;
    let seen: Vec<&Value> = first.as_array().unwrap().iter().collect();
    assert!(
        second
            .as_array()
            .unwrap()
            .iter()
            .all(|id| !seen.contains(&id)),
        "the older page has other runs: {first} then {second}"
    );
    browser.click("nav.pager button:nth-child(1)").await;
    browser
        .wait_for(
            "the first page again",
            &format!(
                "const rows = [...document.querySelectorAll('tbody tr')].map((r) => r.dataset.runId); \
                 return JSON.stringify(rows) === '{first}';"
            ),
        )
        .await;
    browser
        .find("select[name=status]")
        .await
        .select_by_value("cancelled")
        .await
        .unwrap();
    browser.click("form.filters button[type=submit]").await;
    let rows = browser
        .wait_for(
            "only cancelled runs",
            "const rows = [...document.querySelectorAll('tbody tr')]; \
             const all = rows.every((r) => r.querySelector('.badge').textContent === 'cancelled'); \
             return rows.length > 0 && all && rows.map((r) => r.dataset.runId);",
        )
        .await;
    assert_eq!(rows, json!([cancelled_run]), "the status filter");
    browser
        .click(&format!("tr[data-run-id='{cancelled_run}'] a"))
        .await;
    browser.page_ready("runs").await;
    let types = browser
        .wait_for(
            "the run's items",
            "if (document.querySelector('.stream-state')?.dataset.state !== 'ended') return null; \
             return [...document.querySelectorAll('.items li code.type')].map((c) => c.textContent);",
        )
        .await;
    assert_eq!(types, json!(["message.delta", "run.failed"]), "the items");
    browser.screenshot("run").await;

    // A live run: its items appear as they are produced; Cancel on its page ends it.
    let event = api.send_message("console-scripts", "cancellable").await;
    let live_run = api.run_of(event).await;
    browser.goto(&format!("{base}/#/runs/{live_run}")).await;
    browser
        .wait_for(
            "the live run's first item",
            "return document.querySelector('.stream-state')?.dataset.state === 'live' \
             && document.querySelectorAll('.items li').length === 1;",
        )
        .await;
    // The connection drops: the page reconnects and goes on after the last item it showed.
    let before = proxy.accepted();
    proxy.cut();
    let deadline = Instant::now() + STEP;
    while proxy.accepted() == before {
        assert!(Instant::now() < deadline, "the page never reconnected");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    browser
        .wait_for(
            "the stream live again",
            "return document.querySelector('.stream-state')?.dataset.state === 'live';",
        )
        .await;
    browser.click("main button.danger").await;
    let types = browser
        .wait_for(
            "the live run's terminal item",
            "if (document.querySelector('.stream-state')?.dataset.state !== 'ended') return null; \
             return [...document.querySelectorAll('.items li code.type')].map((c) => c.textContent);",
        )
        .await;
    assert_eq!(
        types,
        json!(["message.delta", "run.failed"]),
        "no gap, no duplicate"
    );
    browser
        .wait_for(
            "the run's status refreshed",
            "return document.querySelector('.fields .badge')?.textContent === 'cancelled';",
        )
        .await;

    // Agents: a refused agent shows the API's error; a valid one appears in the list.
    browser.goto(&format!("{base}/#/agents")).await;
    browser.page_ready("agents").await;
    browser.click("details.card-create > summary").await;
    browser
        .type_into("form.resource-form input[name=name]", "console-made")
        .await;
    browser
        .find("form.resource-form select[name=runner_id]")
        .await
        .select_by_value("plugin:switchboard/echo/default")
        .await
        .expect("the echo runner is offered");
    browser
        .click("form.resource-form button[type=submit]")
        .await;
    let error = browser
        .wait_for(
            "the refused agent's error",
            "const e = document.getElementById('error'); \
             return !e.hidden && e.querySelector('.error-code').textContent;",
        )
        .await;
    assert_eq!(error, json!("conflict"), "a second workspace-wide agent");
    browser
        .type_into(
            "form.resource-form textarea[name=scope]",
            r#"{"conversation_id": "console-made"}"#,
        )
        .await;
    browser
        .click("form.resource-form button[type=submit]")
        .await;
    browser
        .wait_for(
            "the new agent in the list",
            "return [...document.querySelectorAll('table.resources-agents tbody tr')] \
             .some((r) => r.textContent.includes('console-made'));",
        )
        .await;
    let agents = api.get("/v1/agents").await.expect(200);
    let made = agents.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "console-made")
        .expect("the agent was created");
    assert_eq!(made["scope"]["conversation_id"], "console-made");
    browser.screenshot("agents").await;

    // A knowledge base: created, edited (PATCH), deleted (after a confirmation).
    browser.goto(&format!("{base}/#/knowledge-bases")).await;
    browser.page_ready("knowledge-bases").await;
    browser
        .wait_for(
            "the create form open on an empty page",
            "return document.querySelector('details.card-create').open;",
        )
        .await;
    browser
        .type_into("details.card-create input[name=name]", "handbook")
        .await;
    browser
        .click("details.card-create button[type=submit]")
        .await;
    let kb_id = browser
        .wait_for(
            "the new knowledge base",
            "const r = document.querySelector('table.resources-knowledge-bases tbody tr'); \
             return r && r.textContent.includes('handbook') && r.dataset.id;",
        )
        .await;
    let kb_id = kb_id.as_str().unwrap().to_owned();
    let row = format!("tr[data-id='{kb_id}']");
    browser
        .click(&format!("{row} details.card-edit > summary"))
        .await;
    browser
        .type_into(
            &format!("{row} input[name=description]"),
            "what new people read",
        )
        .await;
    browser
        .click(&format!("{row} details.card-edit button[type=submit]"))
        .await;
    browser
        .wait_for(
            "the edited description",
            &format!(
                "return document.querySelector(\"{row}\")?.textContent.includes('what new people read');"
            ),
        )
        .await;
    let kb = api
        .get(&format!("/v1/knowledge-bases/{kb_id}"))
        .await
        .expect(200);
    assert_eq!(kb.body["description"], "what new people read");
    browser.screenshot("knowledge-bases").await;
    browser.click(&format!("{row} button.danger")).await;
    browser
        .client
        .accept_alert()
        .await
        .expect("the confirmation");
    browser
        .wait_for(
            "the knowledge base gone",
            "return document.querySelector('main p.empty') !== null;",
        )
        .await;
    api.get(&format!("/v1/knowledge-bases/{kb_id}"))
        .await
        .expect(404);

    // Every other page renders (with what the workspace has).
    for page in ["runners", "models", "tools", "schedules"] {
        browser.goto(&format!("{base}/#/{page}")).await;
        browser.page_ready(page).await;
        if page == "runners" {
            browser
                .wait_for(
                    "the echo runner listed",
                    "return document.querySelector('main table')?.textContent.includes('switchboard/echo');",
                )
                .await;
        }
        browser.screenshot(page).await;
    }

    // A narrow screen: the chat in one column.
    browser
        .client
        .set_window_size(390, 844)
        .await
        .expect("resize");
    browser.goto(&format!("{base}/#/chat")).await;
    browser.page_ready("chat").await;
    let overflow = browser
        .client
        .execute(
            "return document.documentElement.scrollWidth > window.innerWidth;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(overflow, json!(false), "no horizontal scrolling on a phone");
    browser.screenshot("chat-narrow").await;

    browser.client.clone().close().await.expect("close");
    cluster.shutdown().await;
}

/// The real gateway serves the console without a key, with its security headers, while the
/// API's space keeps its JSON errors.
#[tokio::test]
async fn the_gateway_serves_the_console_without_a_key() {
    let cluster = TestCluster::embedded().await;
    let base = cluster.client().base_url().to_owned();
    let http = reqwest::Client::new();

    let page = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let headers = page.headers().clone();
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert!(page.text().await.unwrap().contains("/console/app.js"));

    let script = http
        .get(format!("{base}/console/app.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(script.status(), 200);
    assert_eq!(
        script.headers()["content-type"],
        "text/javascript; charset=utf-8"
    );

    let missing = http
        .get(format!("{base}/console/missing.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404, "an unknown console file");

    // The API is unchanged: no key is still 401, an unknown route still the JSON 404.
    let api = cluster.client().with_key(None);
    let refused = api.get("/v1/runs").await.expect(401);
    assert_eq!(refused.body["code"], "unauthorized");
    let unknown = cluster.client().get("/v1/no-such-route").await.expect(404);
    assert_eq!(unknown.body["code"], "not_found", "{}", unknown.body);
    cluster.shutdown().await;
}
