//! Reconnect delays: capped exponential backoff with full jitter.
//!
//! Attempt `n` (from 0) has the window `min(cap, initial × 2ⁿ)`; the delay is drawn uniformly
//! from `[window / 10, window]`, so a fleet of agents that lost the same hub spreads its
//! reconnects over the whole window instead of knocking in step. A session that reached the
//! welcome resets the attempts. The small floor keeps a run of unlucky draws from spinning.

use std::time::Duration;

use rand::Rng;

/// The first window: the hub gets a second before the agent knocks again.
pub const BACKOFF_INITIAL: Duration = Duration::from_secs(1);
/// The largest window: a hub that is down for long is tried at least once a minute.
pub const BACKOFF_CAP: Duration = Duration::from_secs(60);

/// The backoff state of one reconnect loop.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    cap: Duration,
    attempt: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(BACKOFF_INITIAL, BACKOFF_CAP)
    }
}

impl Backoff {
    /// A backoff with these bounds (`cap` is raised to `initial` if lower).
    pub fn new(initial: Duration, cap: Duration) -> Self {
        Self {
            initial,
            cap: cap.max(initial),
            attempt: 0,
        }
    }

    /// The window of the next attempt.
    pub fn window(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.cap)
    }

    /// Attempts since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The delay before the next attempt, drawn with `rng`, and the window it came from.
    pub fn next_delay_with(&mut self, rng: &mut impl Rng) -> Duration {
        let window = self.window();
        self.attempt = self.attempt.saturating_add(1);
        let max = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        let min = max / 10;
        Duration::from_micros(rng.random_range(min..=max))
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        self.next_delay_with(&mut rand::rng())
    }

    /// The session came up: start again from the first window.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn windows_double_up_to_the_cap() {
        let mut b = Backoff::default();
        let mut windows = Vec::new();
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..10 {
            windows.push(b.window().as_secs());
            b.next_delay_with(&mut rng);
        }
        assert_eq!(windows, vec![1, 2, 4, 8, 16, 32, 60, 60, 60, 60]);
        b.reset();
        assert_eq!(b.window(), BACKOFF_INITIAL);
        assert_eq!(b.attempts(), 0);
    }

    #[test]
    fn every_delay_is_inside_its_window_and_they_spread() {
        let mut rng = StdRng::seed_from_u64(42);
        for attempt in 0..12 {
            let mut seen = Vec::new();
            for _ in 0..200 {
                let mut b = Backoff::default();
                for _ in 0..attempt {
                    b.next_delay_with(&mut rng);
                }
                let window = b.window();
                let d = b.next_delay_with(&mut rng);
                assert!(d <= window && d >= window / 10, "{d:?} outside {window:?}");
                seen.push(d);
            }
            let min = seen.iter().min().copied().unwrap_or_default();
            let max = seen.iter().max().copied().unwrap_or_default();
            let window = {
                let mut b = Backoff::default();
                for _ in 0..attempt {
                    b.next_delay_with(&mut rng);
                }
                b.window()
            };
            // Full jitter: the draws cover most of the window, not one point.
            assert!(
                max - min > window / 2,
                "attempt {attempt}: {min:?}..{max:?}"
            );
        }
    }

    #[test]
    fn tiny_windows_and_huge_attempt_counts_do_not_overflow() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut b = Backoff::new(Duration::from_millis(20), Duration::from_millis(10));
        assert_eq!(
            b.window(),
            Duration::from_millis(20),
            "cap raised to initial"
        );
        for _ in 0..100 {
            assert!(b.next_delay_with(&mut rng) <= Duration::from_millis(20));
        }
        let mut b = Backoff::new(Duration::from_secs(u64::MAX / 4), Duration::MAX);
        for _ in 0..40 {
            b.next_delay_with(&mut rng);
        }
        assert!(b.window() > Duration::ZERO);
    }
}
