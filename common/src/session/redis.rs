//! Redis [`SessionStore`] (feature `redis`).
//!
//! One [`ConnectionManager`] per store: a multiplexed connection that reconnects on its own
//! (with exponential backoff) after the server goes away, so a call made during an outage
//! fails with [`SessionError::Unavailable`] and a later one succeeds without any action from
//! the caller. Cloning the store clones the manager handle, not the connection.
//!
//! Every operation the contract calls atomic is one Redis command or one Lua script (scripts
//! run atomically on the server; `EVALSHA` with a fallback to `EVAL` is handled by
//! [`redis::Script`]). TTLs use millisecond commands (`PX`, `PEXPIRE`, `PTTL`).

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, RedisError, Script};
use sb_protocol::ids::RunId;
use serde_json::Value;

use super::{
    EndedSession, Keys, PullMode, PushOutcome, Result, RunBegin, RunEnd, SessionError,
    SessionStore, cancel_flag_key, check_ttl, decode_json, run_handed_off_key, run_lease_key,
    ttl_millis,
};

/// Connection options of [`RedisSessionStore`]; the config layer maps its Redis section onto
/// this.
#[derive(Clone)]
pub struct RedisOptions {
    /// `redis://[user:password@]host:port[/db]` (or `rediss://` if the TLS feature is built).
    pub url: String,
    /// Prepended to every key (e.g. `switchboard:`; tests use a unique one).
    pub key_prefix: String,
    /// Limit for establishing a connection (each reconnect attempt).
    pub connect_timeout: Duration,
    /// Limit for one command's response; a stalled server becomes `Unavailable`.
    pub response_timeout: Duration,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry a password.
        let url = crate::config::redact_url(&self.url);
        f.debug_struct("RedisOptions")
            .field("url", &url)
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .finish()
    }
}

impl RedisOptions {
    /// Options for `url` with default timeouts (5 s connect, 5 s response) and `key_prefix`.
    pub fn new(url: impl Into<String>, key_prefix: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            key_prefix: key_prefix.into(),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
        }
    }
}

/// The Redis-backed session store.
#[derive(Clone)]
pub struct RedisSessionStore {
    conn: ConnectionManager,
    keys: Keys,
    prefix: String,
    scripts: &'static Scripts,
}

impl std::fmt::Debug for RedisSessionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSessionStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The Lua scripts, parsed (and hashed) once per process.
struct Scripts {
    end_session: Script,
    touch_session: Script,
    steering_push: Script,
    steering_pull: Script,
    acquire_lease: Script,
    renew_lease: Script,
    release_lease: Script,
    begin_run: Script,
    end_run: Script,
    incr_with_ttl: Script,
    try_add: Script,
    set_add: Script,
    acquire_lease_and_get: Script,
    put_session_and_add: Script,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        // KEYS: session, steering. Returns {1, {items…}} if the session existed (and is
        // removed now, with its list), else {0, {}}.
        end_session: Script::new(
            r"
            if redis.call('DEL', KEYS[1]) == 0 then return {0, {}} end
            local items = redis.call('LRANGE', KEYS[2], 0, -1)
            redis.call('DEL', KEYS[2])
            return {1, items}
            ",
        ),
        // KEYS: session, steering. ARGV: ttl ms. Returns 1 if the session exists.
        touch_session: Script::new(
            r"
            if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
            redis.call('PEXPIRE', KEYS[2], ARGV[1])
            return 1
            ",
        ),
        // KEYS: session, steering. ARGV: item, cap. Returns 0 accepted, 1 full, 2 no session.
        // The list gets the session's remaining TTL so it expires with it.
        steering_push: Script::new(
            r"
            local ttl = redis.call('PTTL', KEYS[1])
            if ttl == -2 then return 2 end
            if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then return 1 end
            redis.call('RPUSH', KEYS[2], ARGV[1])
            if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
            return 0
            ",
        ),
        // KEYS: steering. ARGV: max. Pops up to max items from the head.
        steering_pull: Script::new(
            r"
            local n = tonumber(ARGV[1])
            if n <= 0 then return {} end
            local items = redis.call('LRANGE', KEYS[1], 0, n - 1)
            if #items > 0 then redis.call('LTRIM', KEYS[1], #items, -1) end
            return items
            ",
        ),
        // KEYS: lease. ARGV: holder, ttl ms.
        acquire_lease: Script::new(
            r"
            local cur = redis.call('GET', KEYS[1])
            if cur == ARGV[1] then
              redis.call('PEXPIRE', KEYS[1], ARGV[2])
              return 1
            end
            if cur then return 0 end
            redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
            return 1
            ",
        ),
        // KEYS: lease. ARGV: holder, ttl ms.
        renew_lease: Script::new(
            r"
            if redis.call('GET', KEYS[1]) == ARGV[1] then
              redis.call('PEXPIRE', KEYS[1], ARGV[2])
              return 1
            end
            return 0
            ",
        ),
        // KEYS: lease. ARGV: holder.
        release_lease: Script::new(
            r"
            if redis.call('GET', KEYS[1]) == ARGV[1] then
              redis.call('DEL', KEYS[1])
              return 1
            end
            return 0
            ",
        ),
        // KEYS: lease, cancel flag, session. ARGV: holder, ttl ms. The lease part is
        // acquire_lease's. Returns {0, holder, nil} if another holder has the lease, else
        // {1, flag or nil, session or nil}.
        begin_run: Script::new(
            r"
            local cur = redis.call('GET', KEYS[1])
            if cur and cur ~= ARGV[1] then return {0, cur, false} end
            if cur then
              redis.call('PEXPIRE', KEYS[1], ARGV[2])
            else
              redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
            end
            return {1, redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
            ",
        ),
        // KEYS: session, steering, cancel flag, hand-off marker, lease. ARGV: holder, marker
        // ttl ms. The session part is end_session's, the lease part release_lease's.
        // Returns {1 if the session existed else 0, {items…}, 1 if the lease was released
        // else 0}.
        end_run: Script::new(
            r"
            local s = redis.call('DEL', KEYS[1])
            local items = {}
            if s == 1 then
              items = redis.call('LRANGE', KEYS[2], 0, -1)
              redis.call('DEL', KEYS[2])
            end
            redis.call('DEL', KEYS[3])
            redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[2])
            local released = 0
            if redis.call('GET', KEYS[5]) == ARGV[1] then
              redis.call('DEL', KEYS[5])
              released = 1
            end
            return {s, items, released}
            ",
        ),
        // KEYS: counter. ARGV: by, ttl ms (0 = none). The TTL is only set when missing.
        incr_with_ttl: Script::new(
            r"
            local v = redis.call('INCRBY', KEYS[1], ARGV[1])
            local ttl = tonumber(ARGV[2])
            if ttl > 0 and redis.call('PTTL', KEYS[1]) == -1 then
              redis.call('PEXPIRE', KEYS[1], ttl)
            end
            return v
            ",
        ),
        // KEYS: counter, exhausted marker. ARGV: by, limit, ttl ms (0 = none).
        // Returns {1, new value} or {0, current value} (exhausted; marker set with the
        // counter's TTL, or the given one if the counter has none).
        try_add: Script::new(
            r"
            local used = tonumber(redis.call('GET', KEYS[1]) or '0')
            local by = tonumber(ARGV[1])
            local limit = tonumber(ARGV[2])
            local ttl = tonumber(ARGV[3])
            if redis.call('EXISTS', KEYS[2]) == 1 or used + by > limit then
              local pttl = redis.call('PTTL', KEYS[1])
              if pttl > 0 then
                redis.call('SET', KEYS[2], '1', 'PX', pttl)
              elseif ttl > 0 then
                redis.call('SET', KEYS[2], '1', 'PX', ttl)
              else
                redis.call('SET', KEYS[2], '1')
              end
              return {0, used}
            end
            local v = redis.call('INCRBY', KEYS[1], by)
            if ttl > 0 and redis.call('PTTL', KEYS[1]) == -1 then
              redis.call('PEXPIRE', KEYS[1], ttl)
            end
            return {1, v}
            ",
        ),
        // KEYS: set. ARGV: member, ttl ms (0 = keep).
        set_add: Script::new(
            r"
            local added = redis.call('SADD', KEYS[1], ARGV[1])
            local ttl = tonumber(ARGV[2])
            if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
            return added
            ",
        ),
        // KEYS: lease, plain key. ARGV: holder, ttl ms. The lease part is acquire_lease's.
        // Returns {1 if taken else 0, the plain key's value or nil}. Run only when the
        // holder has the lease already (see `acquire_lease_and_get`).
        acquire_lease_and_get: Script::new(
            r"
            local cur = redis.call('GET', KEYS[1])
            local won = 0
            if cur == ARGV[1] then
              redis.call('PEXPIRE', KEYS[1], ARGV[2])
              won = 1
            elseif not cur then
              redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
              won = 1
            end
            return {won, redis.call('GET', KEYS[2])}
            ",
        ),
        // KEYS: session, set. ARGV: session, ttl ms, member, set ttl ms (0 = none). The set
        // part is set_add's.
        put_session_and_add: Script::new(
            r"
            redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
            redis.call('SADD', KEYS[2], ARGV[3])
            local ttl = tonumber(ARGV[4])
            if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
            return 1
            ",
        ),
    })
}

/// Maps a Redis error: connection-level problems are `Unavailable` (retryable), the rest is
/// `Internal`.
fn map_err(e: RedisError) -> SessionError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        SessionError::Unavailable(e.to_string())
    } else {
        SessionError::Internal(e.to_string())
    }
}

impl RedisSessionStore {
    /// Connects (one attempt, bounded by `connect_timeout`); later disconnections are repaired
    /// in the background.
    pub async fn connect(options: &RedisOptions) -> Result<Self> {
        let client = redis::Client::open(options.url.as_str())
            .map_err(|e| SessionError::InvalidArgument(format!("invalid redis url: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(options.connect_timeout)
            .set_response_timeout(options.response_timeout)
            // Reconnect attempts: 100 ms, 200 ms, … capped at 5 s between tries.
            .set_factor(100)
            .set_exponent_base(2)
            .set_max_delay(5_000)
            .set_number_of_retries(6);
        let conn = tokio::time::timeout(
            options.connect_timeout,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| SessionError::Unavailable("timed out connecting to redis".into()))?
        .map_err(map_err)?;
        Ok(Self {
            conn,
            keys: Keys::new(options.key_prefix.clone()),
            prefix: options.key_prefix.clone(),
            scripts: scripts(),
        })
    }

    fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// Deletes every key under this store's prefix (test teardown, `switchboard` resets).
    /// Uses `SCAN`, so it does not block the server; keys written meanwhile may survive.
    pub async fn delete_all(&self) -> Result<u64> {
        if self.prefix.is_empty() {
            return Err(SessionError::InvalidArgument(
                "refusing to delete every key of a store without prefix".into(),
            ));
        }
        let pattern = format!("{}*", glob_escape(&self.prefix));
        let mut conn = self.conn();
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(500)
                .query_async(&mut conn)
                .await
                .map_err(map_err)?;
            if !keys.is_empty() {
                let n: u64 = redis::cmd("DEL")
                    .arg(&keys)
                    .query_async(&mut conn)
                    .await
                    .map_err(map_err)?;
                deleted += n;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }
}

impl RedisSessionStore {
    /// Makes the server drop this store's connection (`CLIENT KILL ID`), as a network failure
    /// or a server restart would; the connection manager reconnects on the next calls. For
    /// recovery tests and chaos drills.
    pub async fn sever_connection(&self) -> Result<()> {
        let mut conn = self.conn();
        let id: i64 = redis::cmd("CLIENT")
            .arg("ID")
            .query_async(&mut conn)
            .await
            .map_err(map_err)?;
        // The reply may be lost with the connection: only the effect matters.
        let _: std::result::Result<i64, RedisError> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async(&mut conn)
            .await;
        Ok(())
    }
}

impl RedisSessionStore {
    /// Decodes what the `end_session` part of a script returned: whether the session existed
    /// (`1`) and its steering items.
    fn ended_session(
        &self,
        run_id: &RunId,
        existed: i64,
        items: &[Vec<u8>],
    ) -> Result<Option<EndedSession>> {
        if existed != 1 {
            return Ok(None);
        }
        let steering_key = self.keys.steering(run_id);
        Ok(Some(EndedSession {
            steering: items
                .iter()
                .map(|item| decode_json(&steering_key, item))
                .collect::<Result<_>>()?,
        }))
    }
}

/// Escapes Redis glob metacharacters.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn json_bytes(value: &Value) -> Vec<u8> {
    serde_json::to_vec(value).expect("serde_json::Value always serializes")
}

#[async_trait]
impl SessionStore for RedisSessionStore {
    async fn put_session(&self, run_id: &RunId, session: &Value, ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        let () = self
            .conn()
            .pset_ex(
                self.keys.session(run_id),
                json_bytes(session),
                ttl_millis(ttl),
            )
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn get_session(&self, run_id: &RunId) -> Result<Option<Value>> {
        let key = self.keys.session(run_id);
        let raw: Option<Vec<u8>> = self.conn().get(&key).await.map_err(map_err)?;
        raw.map(|bytes| decode_json(&key, &bytes)).transpose()
    }

    async fn touch_session(&self, run_id: &RunId, ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        let touched: i64 = self
            .scripts
            .touch_session
            .key(self.keys.session(run_id))
            .key(self.keys.steering(run_id))
            .arg(ttl_millis(ttl))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(touched == 1)
    }

    async fn end_session(&self, run_id: &RunId) -> Result<Option<EndedSession>> {
        let (existed, items): (i64, Vec<Vec<u8>>) = self
            .scripts
            .end_session
            .key(self.keys.session(run_id))
            .key(self.keys.steering(run_id))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        self.ended_session(run_id, existed, &items)
    }

    async fn steering_push(&self, run_id: &RunId, item: &Value, cap: usize) -> Result<PushOutcome> {
        let outcome: i64 = self
            .scripts
            .steering_push
            .key(self.keys.session(run_id))
            .key(self.keys.steering(run_id))
            .arg(json_bytes(item))
            .arg(cap.min(u32::MAX as usize))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(match outcome {
            0 => PushOutcome::Accepted,
            1 => PushOutcome::Full,
            _ => PushOutcome::NoSession,
        })
    }

    async fn steering_pull(
        &self,
        run_id: &RunId,
        max: usize,
        mode: PullMode,
    ) -> Result<Vec<Value>> {
        // Lua numbers are doubles: keep the count exactly representable.
        let take = match mode {
            PullMode::All => max.min(u32::MAX as usize),
            PullMode::One => max.min(1),
        };
        let key = self.keys.steering(run_id);
        let items: Vec<Vec<u8>> = self
            .scripts
            .steering_pull
            .key(&key)
            .arg(take)
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        items.iter().map(|item| decode_json(&key, item)).collect()
    }

    async fn steering_len(&self, run_id: &RunId) -> Result<usize> {
        self.conn()
            .llen(self.keys.steering(run_id))
            .await
            .map_err(map_err)
    }

    async fn acquire_lease(&self, key: &str, holder: &str, ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        let won: i64 = self
            .scripts
            .acquire_lease
            .key(self.keys.lease(key))
            .arg(holder)
            .arg(ttl_millis(ttl))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(won == 1)
    }

    /// A free lease, the router's case for every event, is taken with plain commands in one
    /// round trip (`SET NX`, then the holder and the key read back): a script costs Redis
    /// several times what a plain command does (under the cluster benchmark's load, 19 µs for
    /// this one against 1.5–3.4 µs for a command). Only when the lease is the caller's
    /// already does the script run, to reset its TTL and read the key after that.
    async fn acquire_lease_and_get(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
        read: &str,
    ) -> Result<(bool, Option<Vec<u8>>)> {
        check_ttl(ttl)?;
        let lease = self.keys.lease(key);
        let (taken, current, value): (Option<String>, Option<Vec<u8>>, Option<Vec<u8>>) =
            redis::pipe()
                .cmd("SET")
                .arg(&lease)
                .arg(holder)
                .arg("NX")
                .arg("PX")
                .arg(ttl_millis(ttl))
                .get(&lease)
                .get(self.keys.kv(read))
                .query_async(&mut self.conn())
                .await
                .map_err(map_err)?;
        if taken.is_some() {
            return Ok((true, value));
        }
        if current.as_deref() != Some(holder.as_bytes()) {
            return Ok((false, value));
        }
        let (won, value): (i64, Option<Vec<u8>>) = self
            .scripts
            .acquire_lease_and_get
            .key(self.keys.lease(key))
            .key(self.keys.kv(read))
            .arg(holder)
            .arg(ttl_millis(ttl))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok((won == 1, value))
    }

    async fn put_session_and_add(
        &self,
        run_id: &RunId,
        session: &Value,
        ttl: Duration,
        set: &str,
        member: &str,
        set_ttl: Option<Duration>,
    ) -> Result<()> {
        check_ttl(ttl)?;
        if let Some(set_ttl) = set_ttl {
            check_ttl(set_ttl)?;
        }
        let _: i64 = self
            .scripts
            .put_session_and_add
            .key(self.keys.session(run_id))
            .key(self.keys.set(set))
            .arg(json_bytes(session))
            .arg(ttl_millis(ttl))
            .arg(member)
            .arg(set_ttl.map_or(0, ttl_millis))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn renew_lease(&self, key: &str, holder: &str, ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        let renewed: i64 = self
            .scripts
            .renew_lease
            .key(self.keys.lease(key))
            .arg(holder)
            .arg(ttl_millis(ttl))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        if renewed == 1 {
            Ok(())
        } else {
            Err(SessionError::LeaseLost {
                key: key.to_owned(),
            })
        }
    }

    async fn release_lease(&self, key: &str, holder: &str) -> Result<bool> {
        let released: i64 = self
            .scripts
            .release_lease
            .key(self.keys.lease(key))
            .arg(holder)
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(released == 1)
    }

    async fn lease_holder(&self, key: &str) -> Result<Option<String>> {
        self.conn().get(self.keys.lease(key)).await.map_err(map_err)
    }

    async fn begin_run(&self, run_id: &RunId, holder: &str, ttl: Duration) -> Result<RunBegin> {
        check_ttl(ttl)?;
        let session_key = self.keys.session(run_id);
        let (leased, value, session): (i64, Option<Vec<u8>>, Option<Vec<u8>>) = self
            .scripts
            .begin_run
            .key(self.keys.lease(&run_lease_key(run_id)))
            .key(self.keys.kv(&cancel_flag_key(run_id)))
            .key(&session_key)
            .arg(holder)
            .arg(ttl_millis(ttl))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(if leased == 1 {
            RunBegin::Leased {
                cancel_flag: value,
                session: session
                    .map(|bytes| decode_json(&session_key, &bytes))
                    .transpose()?,
            }
        } else {
            RunBegin::HeldBy(String::from_utf8_lossy(&value.unwrap_or_default()).into_owned())
        })
    }

    async fn end_run(
        &self,
        run_id: &RunId,
        holder: &str,
        handed_off_ttl: Duration,
    ) -> Result<RunEnd> {
        check_ttl(handed_off_ttl)?;
        let (existed, items, released): (i64, Vec<Vec<u8>>, i64) = self
            .scripts
            .end_run
            .key(self.keys.session(run_id))
            .key(self.keys.steering(run_id))
            .key(self.keys.kv(&cancel_flag_key(run_id)))
            .key(self.keys.kv(&run_handed_off_key(run_id)))
            .key(self.keys.lease(&run_lease_key(run_id)))
            .arg(holder)
            .arg(ttl_millis(handed_off_ttl))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(RunEnd {
            ended: self.ended_session(run_id, existed, &items)?,
            lease_released: released == 1,
        })
    }

    async fn counter_incr(&self, key: &str, by: i64, ttl: Option<Duration>) -> Result<i64> {
        if let Some(ttl) = ttl {
            check_ttl(ttl)?;
        }
        self.scripts
            .incr_with_ttl
            .key(self.keys.counter(key))
            .arg(by)
            .arg(ttl.map_or(0, ttl_millis))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)
    }

    async fn counter_get(&self, key: &str) -> Result<i64> {
        let v: Option<i64> = self
            .conn()
            .get(self.keys.counter(key))
            .await
            .map_err(map_err)?;
        Ok(v.unwrap_or(0))
    }

    async fn counter_try_add(
        &self,
        key: &str,
        by: i64,
        limit: i64,
        ttl: Option<Duration>,
    ) -> Result<i64> {
        if by < 0 {
            return Err(SessionError::InvalidArgument(
                "a budget cannot be refunded (by < 0)".into(),
            ));
        }
        if let Some(ttl) = ttl {
            check_ttl(ttl)?;
        }
        let (ok, value): (i64, i64) = self
            .scripts
            .try_add
            .key(self.keys.counter(key))
            .key(self.keys.exhausted(key))
            .arg(by)
            .arg(limit)
            .arg(ttl.map_or(0, ttl_millis))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        if ok == 1 {
            Ok(value)
        } else {
            Err(SessionError::Exhausted {
                key: key.to_owned(),
                used: value,
                limit,
            })
        }
    }

    async fn rate_limit_hit(
        &self,
        key: &str,
        max_per_window: u32,
        window: Duration,
    ) -> Result<bool> {
        check_ttl(window)?;
        let hits: i64 = self
            .scripts
            .incr_with_ttl
            .key(self.keys.rate(key))
            .arg(1)
            .arg(ttl_millis(window))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(hits <= i64::from(max_per_window))
    }

    async fn set_ex(&self, key: &str, value: &[u8], ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        let () = self
            .conn()
            .pset_ex(self.keys.kv(key), value, ttl_millis(ttl))
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn set_nx_ex(&self, key: &str, value: &[u8], ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        let set: Option<String> = redis::cmd("SET")
            .arg(self.keys.kv(key))
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(ttl_millis(ttl))
            .query_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(set.is_some())
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.conn().get(self.keys.kv(key)).await.map_err(map_err)
    }

    async fn del(&self, key: &str) -> Result<bool> {
        let n: i64 = self.conn().del(self.keys.kv(key)).await.map_err(map_err)?;
        Ok(n > 0)
    }

    async fn set_add(&self, key: &str, member: &str, ttl: Option<Duration>) -> Result<bool> {
        if let Some(ttl) = ttl {
            check_ttl(ttl)?;
        }
        let added: i64 = self
            .scripts
            .set_add
            .key(self.keys.set(key))
            .arg(member)
            .arg(ttl.map_or(0, ttl_millis))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(added == 1)
    }

    async fn set_remove(&self, key: &str, member: &str) -> Result<bool> {
        let n: i64 = self
            .conn()
            .srem(self.keys.set(key), member)
            .await
            .map_err(map_err)?;
        Ok(n > 0)
    }

    async fn set_members(&self, key: &str) -> Result<Vec<String>> {
        let mut members: Vec<String> = self
            .conn()
            .smembers(self.keys.set(key))
            .await
            .map_err(map_err)?;
        members.sort();
        Ok(members)
    }

    async fn set_remove_then_members(
        &self,
        key: &str,
        member: &str,
        members_of: &str,
    ) -> Result<(bool, Vec<String>)> {
        // MULTI/EXEC: both commands in one round trip, nothing runs in between.
        let (removed, mut members): (i64, Vec<String>) = redis::pipe()
            .atomic()
            .srem(self.keys.set(key), member)
            .smembers(self.keys.set(members_of))
            .query_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        members.sort();
        Ok((removed > 0, members))
    }

    async fn ping(&self) -> Result<()> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_escaping() {
        assert_eq!(glob_escape("test-1."), "test-1.");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }

    #[test]
    fn debug_redacts_the_password() {
        let options = RedisOptions::new("redis://user:secret@localhost:6379/0", "p:");
        let shown = format!("{options:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("***"));
    }
}
