//! Which orchestrator consumes which shard queue (SPEC §2/§3: one conversation's events and
//! one run's results are handled in order, while the shards spread across orchestrators).
//!
//! Every `switchboard.events.<k>` / `switchboard.results.<k>` queue is single-active-consumer,
//! and RabbitMQ makes the *first* subscriber active. If every orchestrator subscribed to every
//! shard, the first one started would do all the work. Instead each orchestrator consumes
//! only the shards [`assign`] gives it among the live members, and the single-active-consumer
//! flag stays as the safety net: while two members briefly disagree about the membership
//! (one saw a join or a leave a tick before the other), both may be subscribed to a shard, and
//! the broker still hands its messages to one of them only.
//!
//! # Layout
//! - [`assign`] / [`owners`]: rendezvous (highest-random-weight) hashing of shards onto
//!   members, with bounded load. Pure: every process computing it over the same members
//!   gets the same answer, each shard has exactly one owner, the split is even, and a join
//!   or leave moves little more than the shards that must move.
//! - [`Membership`]: the live-member registry in the session store (a heartbeat key per
//!   member, plus an index set), read by the orchestrator's shard reconciler (`service`,
//!   which uses this module, not the other way round).
//!
//! # Key space (session store)
//! ```text
//! kv:orchestrators/<id>   member heartbeat, TTL = membership TTL, value = <id>
//! set:orchestrators       index of member ids (dead ids are pruned when their key is gone)
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use sb_common::session::{Result as SessionResult, SessionStore};
use sha2::{Digest, Sha256};

/// Which shard queues a shard number refers to. Each family is hashed with its own salt, so
/// events shard `k` and results shard `k` are placed independently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShardFamily {
    /// `switchboard.events.<k>` (by conversation).
    Events,
    /// `switchboard.results.<k>` (by run).
    Results,
}

impl ShardFamily {
    /// Short name, used as the hash salt and in task names and logs.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Events => "events",
            Self::Results => "results",
        }
    }
}

impl std::fmt::Display for ShardFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rendezvous weight of `member` for `shard`: the first 8 bytes of
/// `sha256(family ‖ 0 ‖ member ‖ 0 ‖ shard as big-endian u32)`.
///
/// A cryptographic hash rather than `std`'s hasher because every orchestrator process (maybe
/// built by different compilers during a rolling upgrade) must compute the same weights.
fn weight(family: ShardFamily, shard: u32, member: &str) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(family.as_str().as_bytes());
    hasher.update([0]);
    hasher.update(member.as_bytes());
    hasher.update([0]);
    hasher.update(shard.to_be_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The owner of every shard among `0..shards` (indexed by shard) when the live members are
/// `members`: rendezvous hashing with bounded load. Empty only when `members` is empty.
///
/// Plain rendezvous hashing (each shard to its highest-weight member) moves the fewest
/// shards on a join or leave, but with few shards it is lopsided: 8 shards over 2 members
/// split 6/2 about a third of the time, and the busier orchestrator then caps throughput.
/// So members are filled to a bound instead: every (shard, member) pair is visited from the
/// highest weight down, and a shard goes to its best member that still has room. A member
/// owns `⌊shards/members⌋` shards, or one more while the remainder lasts, so the split is
/// always even. Balance costs some extra movement on a membership change, which is cheap: a
/// moved shard is one single-active-consumer handover, and the broker keeps the queue's
/// order across it.
#[must_use]
pub fn owners<'a, I>(family: ShardFamily, shards: u32, members: I) -> Vec<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    owners_after(family, shards, members, &BTreeMap::new())
}

/// [`owners`], for a family placed after others: `held` is how many shards each member
/// already owns (of the families placed before), and the shards that do not split evenly go
/// to the members holding the fewest. With one events shard and one results shard over two
/// orchestrators, the results shard goes to the orchestrator that does not route, instead of
/// to either one by its hash; the split within the family stays even either way.
///
/// The remainder goes first to every member below the `level` (the `extra`-th smallest
/// count; 0 when the family splits evenly, so nobody is below it), then to the members at
/// the level in weight order; a member above it owns `⌊shards/members⌋`. With equal counts
/// (no earlier family) this is [`owners`]' fill.
#[must_use]
pub fn owners_after<'a, I>(
    family: ShardFamily,
    shards: u32,
    members: I,
    held: &BTreeMap<&str, u32>,
) -> Vec<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let members: BTreeSet<&str> = members.into_iter().collect();
    if members.is_empty() || shards == 0 {
        return Vec::new();
    }
    let count = u32::try_from(members.len()).unwrap_or(u32::MAX);
    let (floor, extra) = (shards / count, shards % count);
    let before = |member: &str| held.get(member).copied().unwrap_or(0);
    let mut levels: Vec<u32> = members.iter().map(|m| before(m)).collect();
    levels.sort_unstable();
    // The level up to which members may own one shard more than the floor.
    let level = match extra {
        0 => 0,
        n => levels[n as usize - 1],
    };
    let below = members.iter().filter(|m| before(m) < level).count();
    // Extra shards left for the members at `level`, first come (by weight) first served.
    let mut at_level = extra - u32::try_from(below).unwrap_or(extra);
    let mut pairs: Vec<(u64, &str, u32)> = (0..shards)
        .flat_map(|shard| {
            members
                .iter()
                .map(move |member| (weight(family, shard, member), *member, shard))
        })
        .collect();
    // Highest weight first; ties (astronomically unlikely) go to the greater id, then shard.
    pairs.sort_unstable_by(|a, b| b.cmp(a));
    let mut owner: Vec<Option<&str>> = vec![None; shards as usize];
    let mut load: BTreeMap<&str, u32> = BTreeMap::new();
    for (_, member, shard) in pairs {
        let slot = &mut owner[shard as usize];
        let owned = load.entry(member).or_default();
        if slot.is_some() {
            continue;
        }
        if *owned < floor || (*owned == floor && before(member) < level) {
            *owned += 1;
        } else if *owned == floor && at_level > 0 && before(member) == level {
            *owned += 1;
            at_level -= 1;
        } else {
            continue;
        }
        *slot = Some(member);
    }
    // Capacity (floor × members + remainder) equals the shard count and every member bids
    // for every shard, so every shard found an owner.
    owner.into_iter().flatten().collect()
}

/// The shards of both families that `me` owns when the live members are `members`: the
/// events shards by [`owners`], then the results shards by [`owners_after`] the events
/// shards, so that the two families spread over the members together.
///
/// `me` always counts as a member, whether or not `members` lists it (a process that is
/// running is alive, even if its own heartbeat has not been read back yet). With no other
/// member, `me` owns every shard.
#[must_use]
pub fn assign(
    events_shards: u32,
    results_shards: u32,
    members: &BTreeSet<String>,
    me: &str,
) -> BTreeSet<(ShardFamily, u32)> {
    let everyone: BTreeSet<&str> = members
        .iter()
        .map(String::as_str)
        .chain(std::iter::once(me))
        .collect();
    let events = owners(ShardFamily::Events, events_shards, everyone.iter().copied());
    let mut held: BTreeMap<&str, u32> = BTreeMap::new();
    for owner in &events {
        *held.entry(owner).or_default() += 1;
    }
    let results = owners_after(
        ShardFamily::Results,
        results_shards,
        everyone.iter().copied(),
        &held,
    );
    let events = (0..).zip(events).map(|(k, o)| (ShardFamily::Events, k, o));
    let results = (0..)
        .zip(results)
        .map(|(k, o)| (ShardFamily::Results, k, o));
    events
        .chain(results)
        .filter_map(|(family, shard, owner)| (owner == me).then_some((family, shard)))
        .collect()
}

/// Index set of member ids (the family prefix `set:` is added by the store).
const MEMBERS_SET: &str = "orchestrators";

/// Heartbeat key of one member (the family prefix `kv:` is added by the store).
fn member_key(id: &str) -> String {
    format!("orchestrators/{id}")
}

/// One orchestrator's entry in the live-member registry.
///
/// A member is live while its heartbeat key exists: [`heartbeat`](Self::heartbeat) rewrites
/// it with the membership TTL, so a member that stops heartbeating (crashed, partitioned from
/// the store) drops out one TTL later, and its shards move to the others.
#[derive(Clone)]
pub struct Membership {
    sessions: Arc<dyn SessionStore>,
    id: String,
    ttl: Duration,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("id", &self.id)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl Membership {
    /// The entry of member `id`, live for `ttl` after each heartbeat.
    #[must_use]
    pub fn new(sessions: Arc<dyn SessionStore>, id: impl Into<String>, ttl: Duration) -> Self {
        Self {
            sessions,
            id: id.into(),
            ttl,
        }
    }

    /// This member's id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Marks this member live for another TTL. The key is written before the index entry,
    /// so a reader that finds the id in the index without its key knows it expired.
    pub async fn heartbeat(&self) -> SessionResult<()> {
        self.sessions
            .set_ex(&member_key(&self.id), self.id.as_bytes(), self.ttl)
            .await?;
        // The index outlives the keys; it only goes away once every member stopped
        // heartbeating for several TTLs.
        self.sessions
            .set_add(MEMBERS_SET, &self.id, Some(self.ttl.saturating_mul(4)))
            .await?;
        Ok(())
    }

    /// The ids of the live members (this one included only if its heartbeat is current).
    /// Index entries whose heartbeat key is gone are pruned on the way (best effort: a member
    /// pruned while it was re-registering re-adds itself on its next heartbeat).
    pub async fn live_members(&self) -> SessionResult<BTreeSet<String>> {
        let mut live = BTreeSet::new();
        for id in self.sessions.set_members(MEMBERS_SET).await? {
            if self.sessions.get(&member_key(&id)).await?.is_some() {
                live.insert(id);
            } else if let Err(error) = self.sessions.set_remove(MEMBERS_SET, &id).await {
                tracing::debug!(%error, member = %id, "could not prune an expired member");
            }
        }
        Ok(live)
    }

    /// Removes this member at once (on shutdown), so the others take its shards on their
    /// next tick rather than one TTL later.
    pub async fn leave(&self) -> SessionResult<()> {
        self.sessions.del(&member_key(&self.id)).await?;
        self.sessions.set_remove(MEMBERS_SET, &self.id).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use sb_common::session::memory::MemorySessionStore;

    use super::*;

    fn members(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    /// The shards of one family that `me` owns when that family has `shards` shards (and
    /// the other as many).
    fn assigned(
        family: ShardFamily,
        shards: u32,
        members: &BTreeSet<String>,
        me: &str,
    ) -> BTreeSet<u32> {
        assign(shards, shards, members, me)
            .into_iter()
            .filter_map(|(f, shard)| (f == family).then_some(shard))
            .collect()
    }

    /// shard → owner for every shard, computed through `assign` of every member.
    fn owners_of(family: ShardFamily, shards: u32, ids: &[&str]) -> BTreeMap<u32, String> {
        let set = members(ids);
        let mut owners = BTreeMap::new();
        for id in ids {
            for shard in assigned(family, shards, &set, id) {
                let previous = owners.insert(shard, (*id).to_owned());
                assert!(previous.is_none(), "shard {shard} owned twice");
            }
        }
        owners
    }

    const IDS: [&str; 5] = ["orch-a", "orch-b", "orch-c", "orch-d", "orch-e"];

    #[test]
    fn every_shard_has_exactly_one_owner_and_the_split_is_even() {
        for shards in [1, 7, 8, 10, 64] {
            for n in 1..=IDS.len() {
                for family in [ShardFamily::Events, ShardFamily::Results] {
                    let by_shard = owners_of(family, shards, &IDS[..n]);
                    assert_eq!(by_shard.len(), shards as usize, "{n} members");
                    if family == ShardFamily::Events {
                        let listed = owners(family, shards, IDS[..n].iter().copied());
                        for (shard, id) in &by_shard {
                            assert_eq!(listed[*shard as usize], id.as_str());
                        }
                    }
                    let m = u32::try_from(n).unwrap();
                    for id in &IDS[..n] {
                        let held = by_shard.values().filter(|o| o == id).count();
                        let held = u32::try_from(held).unwrap();
                        assert!(
                            held == shards / m || held == shards.div_ceil(m),
                            "{id} owns {held} of {shards} shards among {n} members"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_lone_member_owns_everything_and_counts_itself() {
        let all: BTreeSet<u32> = (0..8).collect();
        assert_eq!(
            assigned(ShardFamily::Events, 8, &BTreeSet::new(), "solo"),
            all
        );
        assert_eq!(
            assigned(ShardFamily::Results, 8, &members(&["solo"]), "solo"),
            all
        );
        // A member not (yet) listed still takes its share.
        let with_me = assign(64, 64, &members(&["orch-a"]), "orch-b");
        let listed = assign(64, 64, &members(&["orch-a", "orch-b"]), "orch-b");
        assert_eq!(with_me, listed);
        assert!(assign(0, 0, &BTreeSet::new(), "solo").is_empty());
    }

    #[test]
    fn assignment_is_deterministic_and_order_free() {
        let a = owners_of(ShardFamily::Events, 32, &IDS);
        let mut reversed = IDS;
        reversed.reverse();
        let b = owners_of(ShardFamily::Events, 32, &reversed);
        assert_eq!(a, b);
        assert_ne!(
            weight(ShardFamily::Events, 0, "orch-a"),
            weight(ShardFamily::Results, 0, "orch-a"),
            "families are salted"
        );
        // The weight's definition is pinned: it must not change between builds, or during
        // a rolling upgrade two versions would disagree on the owners.
        let expected = {
            let digest = Sha256::digest(b"events\0orch-a\0\0\0\0\x07");
            u64::from_be_bytes(digest[..8].try_into().unwrap())
        };
        assert_eq!(weight(ShardFamily::Events, 7, "orch-a"), expected);
    }

    /// Shards whose owner differs between two assignments.
    fn moved(before: &BTreeMap<u32, String>, after: &BTreeMap<u32, String>) -> usize {
        before
            .iter()
            .filter(|(shard, old)| after.get(shard) != Some(old))
            .count()
    }

    #[test]
    fn a_join_moves_few_shards_between_old_members() {
        for n in 1..IDS.len() {
            let before = owners_of(ShardFamily::Events, 256, &IDS[..n]);
            let after = owners_of(ShardFamily::Events, 256, &IDS[..=n]);
            let to_joiner = after.values().filter(|id| *id == IDS[n]).count();
            let fair = 256 / (n + 1);
            assert!(
                (fair..=fair + 1).contains(&to_joiner),
                "joiner owns {to_joiner}"
            );
            // The bound displaces a few shards between old members besides the ones that
            // must go to the joiner; far fewer than a re-deal (which would move most).
            let churn = moved(&before, &after) - to_joiner;
            assert!(
                churn <= fair / 2,
                "{churn} shards moved between old members"
            );
        }
    }

    #[test]
    fn a_leave_moves_mostly_the_leavers_shards() {
        let before = owners_of(ShardFamily::Results, 256, &IDS);
        for leaver in IDS {
            let rest: Vec<&str> = IDS.iter().copied().filter(|id| *id != leaver).collect();
            let after = owners_of(ShardFamily::Results, 256, &rest);
            let left = before.values().filter(|id| *id == leaver).count();
            let churn = moved(&before, &after) - left;
            assert!(churn <= left / 2, "{churn} shards of staying members moved");
        }
    }

    #[test]
    fn eight_shards_split_four_four_over_two_members() {
        // The default deployment shape: plain rendezvous hashing often split it 6/2.
        for family in [ShardFamily::Events, ShardFamily::Results] {
            let by_shard = owners_of(family, 8, &["orch-a", "orch-b"]);
            let a = by_shard.values().filter(|id| *id == "orch-a").count();
            assert_eq!(a, 4, "{family}: {by_shard:?}");
        }
    }

    /// Each member's shards of both families.
    fn totals(events: u32, results: u32, ids: &[&str]) -> Vec<usize> {
        let set = members(ids);
        ids.iter()
            .map(|id| assign(events, results, &set, id).len())
            .collect()
    }

    #[test]
    fn the_two_families_spread_over_the_members_together() {
        // The default shape: one shard each over two orchestrators — one routes, the other
        // sinks, whatever the member ids.
        for pair in [
            ["orch-a", "orch-b"],
            ["orch-c", "orch-d"],
            ["x", "y"],
            ["b", "a"],
        ] {
            assert_eq!(totals(1, 1, &pair), [1, 1], "{pair:?}");
        }
        // Uneven splits of one family are made up by the other.
        for ids in [&IDS[..3], &IDS[..4], &IDS[..]] {
            for (events, results) in [(1, 1), (2, 1), (8, 8), (7, 9), (3, 2)] {
                let t = totals(events, results, ids);
                let (lo, hi) = (t.iter().min().unwrap(), t.iter().max().unwrap());
                assert!(
                    hi - lo <= 1,
                    "{events} + {results} over {}: {t:?}",
                    ids.len()
                );
            }
        }
        // Without an earlier family, the fill is `owners`' own.
        let none = BTreeMap::new();
        for shards in [1, 7, 64] {
            assert_eq!(
                owners_after(ShardFamily::Results, shards, IDS.iter().copied(), &none),
                owners(ShardFamily::Results, shards, IDS.iter().copied())
            );
        }
    }

    #[tokio::test]
    async fn membership_follows_heartbeats_and_leaves() {
        let store: Arc<dyn SessionStore> = Arc::new(MemorySessionStore::new());
        let ttl = Duration::from_millis(1000);
        let a = Membership::new(Arc::clone(&store), "orch-a", ttl);
        let b = Membership::new(Arc::clone(&store), "orch-b", ttl);
        assert!(a.live_members().await.unwrap().is_empty());

        a.heartbeat().await.unwrap();
        b.heartbeat().await.unwrap();
        assert_eq!(
            a.live_members().await.unwrap(),
            members(&["orch-a", "orch-b"])
        );

        // b stops heartbeating: it drops out after one TTL, and is pruned from the index.
        tokio::time::sleep(Duration::from_millis(700)).await;
        a.heartbeat().await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(a.live_members().await.unwrap(), members(&["orch-a"]));
        assert_eq!(
            store.set_members(MEMBERS_SET).await.unwrap(),
            vec!["orch-a"]
        );

        // b comes back; then a leaves explicitly and is gone at once.
        b.heartbeat().await.unwrap();
        assert_eq!(
            b.live_members().await.unwrap(),
            members(&["orch-a", "orch-b"])
        );
        a.leave().await.unwrap();
        assert_eq!(b.live_members().await.unwrap(), members(&["orch-b"]));
    }
}
