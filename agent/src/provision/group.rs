//! The members of an application group driven together: each member's copy is its own
//! transaction, and these seats keep them in step (`[[restore_test.group]]`).
//!
//! - A member starts once the member before it has ended its boot wait (or ended, failed) and
//!   the group's `boot_delay` has passed after a boot that ended.
//! - A member's checks run once every member has ended its boot wait (or ended): all the
//!   members that could start are up while any member is judged.
//! - After its checks a member waits until every member is judged (or ended) before it goes on
//!   to its destroy: nothing a check of another member needs goes away under it.
//! - A member whose checks failed says which member before it failed first, and why.
//!
//! Every wait ends when the run is stopped (Ctrl-C, SIGTERM), and a member whose drive ends
//! for any reason counts as ended for all the waits ([`Seat`]'s drop).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How far a member has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    /// Restoring, or waiting for its turn to start.
    Waiting,
    /// Its boot wait ended (well or not).
    Booted,
    /// Its checks ran.
    Judged,
    /// Its drive ended.
    Ended,
}

#[derive(Debug)]
struct Member {
    guest: u32,
    name: String,
    stage: watch::Sender<Stage>,
    /// Why it failed, once it did (the first reason recorded).
    failed: Mutex<Option<String>>,
    /// Whether its boot ended well (the boot delay follows only such a boot).
    booted_well: Mutex<bool>,
}

/// One group run: its members in start order.
#[derive(Debug)]
pub struct GroupRun {
    name: String,
    boot_delay: Duration,
    members: Vec<Member>,
}

impl GroupRun {
    /// A run of group `name` whose members are `(guest, guest's name)` in start order.
    pub fn new(name: &str, boot_delay: Duration, members: &[(u32, String)]) -> Arc<GroupRun> {
        Arc::new(GroupRun {
            name: name.to_string(),
            boot_delay,
            members: members
                .iter()
                .map(|(guest, name)| Member {
                    guest: *guest,
                    name: name.clone(),
                    stage: watch::Sender::new(Stage::Waiting),
                    failed: Mutex::new(None),
                    booted_well: Mutex::new(false),
                })
                .collect(),
        })
    }

    /// The seat of member number `index`.
    pub fn seat(self: &Arc<Self>, index: usize) -> Seat {
        Seat {
            run: self.clone(),
            index: index.min(self.members.len().saturating_sub(1)),
        }
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Why a wait of the group ended without its turn: the run was stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// One member's place in its group run.
#[derive(Debug)]
pub struct Seat {
    run: Arc<GroupRun>,
    index: usize,
}

impl Seat {
    fn me(&self) -> &Member {
        &self.run.members[self.index]
    }

    fn reach(&self, stage: Stage) {
        self.me().stage.send_if_modified(|s| {
            if *s < stage {
                *s = stage;
                true
            } else {
                false
            }
        });
    }

    async fn wait_for(
        member: &Member,
        stage: Stage,
        cancel: &CancellationToken,
    ) -> Result<(), Stopped> {
        let mut rx = member.stage.subscribe();
        tokio::select! {
            r = rx.wait_for(|s| *s >= stage) => { let _ = r; Ok(()) }
            () = cancel.cancelled() => Err(Stopped),
        }
    }

    /// The group's name and this member's place, for logs.
    pub fn describe(&self) -> String {
        format!(
            "member {} of {} in group {}",
            self.index + 1,
            self.run.members.len(),
            self.run.name
        )
    }

    /// Wait for this member's turn to start: the member before it ended its boot wait (then
    /// the boot delay passes, after a boot that ended well) or ended.
    pub async fn before_start(&self, cancel: &CancellationToken) -> Result<(), Stopped> {
        let Some(before) = self.index.checked_sub(1).map(|i| &self.run.members[i]) else {
            return Ok(());
        };
        Self::wait_for(before, Stage::Booted, cancel).await?;
        let well = *before
            .booted_well
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if well && !self.run.boot_delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(self.run.boot_delay) => {}
                () = cancel.cancelled() => return Err(Stopped),
            }
        }
        Ok(())
    }

    /// This member's boot wait ended: well, or with why not.
    pub fn booted(&self, failed: Option<&str>) {
        match failed {
            None => {
                *self
                    .me()
                    .booted_well
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
            }
            Some(why) => self.fail(why),
        }
        self.reach(Stage::Booted);
    }

    /// Wait until every member ended its boot wait (or ended).
    pub async fn before_checks(&self, cancel: &CancellationToken) -> Result<(), Stopped> {
        for m in &self.run.members {
            Self::wait_for(m, Stage::Booted, cancel).await?;
        }
        Ok(())
    }

    /// This member's checks ran (with why they failed, if they did); then wait until every
    /// member's did (or it ended).
    pub async fn judged(
        &self,
        failed: Option<&str>,
        cancel: &CancellationToken,
    ) -> Result<(), Stopped> {
        if let Some(why) = failed {
            self.fail(why);
        }
        self.reach(Stage::Judged);
        for m in &self.run.members {
            Self::wait_for(m, Stage::Judged, cancel).await?;
        }
        Ok(())
    }

    /// Record why this member failed (the first reason stays).
    pub fn fail(&self, why: &str) {
        let mut f = self
            .me()
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if f.is_none() {
            *f = Some(crate::error::outside_text_max(why, 300));
        }
    }

    /// The first member started before this one that failed, said for a failing check of this
    /// one: `member 200 (db) failed before it: …`.
    pub fn failed_before(&self) -> Option<String> {
        self.run.members[..self.index].iter().find_map(|m| {
            let f = m
                .failed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            f.as_ref().map(|why| {
                format!(
                    "member {} ({}) of group {} failed before it: {why}",
                    m.guest,
                    crate::error::outside_text_max(&m.name, 40),
                    self.run.name
                )
            })
        })
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.reach(Stage::Ended);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(delay_ms: u64) -> Arc<GroupRun> {
        GroupRun::new(
            "shop",
            Duration::from_millis(delay_ms),
            &[(200, "db".to_string()), (201, "web".to_string())],
        )
    }

    #[tokio::test]
    async fn the_second_member_starts_only_after_the_first_booted_and_the_delay() {
        let r = run(200);
        let (a, b) = (r.seat(0), r.seat(1));
        let cancel = CancellationToken::new();
        let started = std::time::Instant::now();
        let waiting = tokio::spawn({
            let cancel = cancel.clone();
            async move {
                b.before_start(&cancel).await.unwrap();
                std::time::Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !waiting.is_finished(),
            "started before the first member booted"
        );
        a.booted(None);
        let at = waiting.await.unwrap();
        assert!(
            at - started >= Duration::from_millis(300),
            "{:?}",
            at - started
        );
    }

    #[tokio::test]
    async fn a_member_that_ended_lets_the_others_go_and_is_named_first_failed() {
        let r = run(10_000);
        let (a, b) = (r.seat(0), r.seat(1));
        let cancel = CancellationToken::new();
        a.fail("unit postgresql.service failed");
        drop(a);
        // No boot delay after a member that did not boot well.
        tokio::time::timeout(Duration::from_secs(2), b.before_start(&cancel))
            .await
            .unwrap()
            .unwrap();
        b.booted(None);
        tokio::time::timeout(Duration::from_secs(2), b.before_checks(&cancel))
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(Duration::from_secs(2), b.judged(Some("x"), &cancel))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            b.failed_before().as_deref(),
            Some("member 200 (db) of group shop failed before it: unit postgresql.service failed")
        );
    }

    #[tokio::test]
    async fn checks_wait_for_every_member_and_a_stop_ends_the_wait() {
        let r = run(0);
        let (a, _b) = (r.seat(0), r.seat(1));
        let cancel = CancellationToken::new();
        a.booted(None);
        let waiting = tokio::spawn({
            let cancel = cancel.clone();
            async move { a.before_checks(&cancel).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !waiting.is_finished(),
            "checks ran before the second member booted"
        );
        cancel.cancel();
        assert_eq!(waiting.await.unwrap(), Err(Stopped));
    }
}
