//! CPU twins of the stream waits (cuda/wait_stamp.cu).
//!
//! - `wait_stamp`: time a wait of the compute stream on background work. The CPU path runs the
//!   background chain inline, so its waits are the two calls' distance apart; the engine does
//!   not call it there, but the arithmetic is the kernel's.
//! - `wait_epoch`: hold a stream until a host word (a layer's `landed` epoch, written by the
//!   coordinator's step reader) reaches the step's epoch, within a timeout. The CPU path calls
//!   it inline before a layer's gather, as the GPU queues it before the gather on the layer's
//!   background stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{OasisError, Result};

/// How long `wait_epoch` sleeps between looks at the word (the kernel: 1 us).
const EPOCH_NAP: Duration = Duration::from_micros(20);

/// Block until `landed >= want` or `timeout` has passed. `stats` is the kernel's `[waits that
/// gave up, the last one's epoch, nanoseconds held, waits]`: on a timeout `stats[0] += 1` and
/// `stats[1] = want`, and the wait gives up (the caller finds it after the step); every wait adds
/// its time to `stats[2]` and counts in `stats[3]`. Returns whether it timed out.
///
/// # Errors
/// [`OasisError::Shape`] unless `stats` has 4 elements.
pub fn wait_epoch(
    landed: &AtomicU64,
    want: u64,
    timeout: Duration,
    stats: &mut [u64],
) -> Result<bool> {
    if stats.len() != 4 {
        return Err(OasisError::Shape {
            what: "stats",
            expected: "[4]".into(),
            got: format!("[{}]", stats.len()),
        });
    }
    let t0 = Instant::now();
    let mut gave_up = false;
    while landed.load(Ordering::Acquire) < want {
        if t0.elapsed() >= timeout {
            stats[0] = stats[0].wrapping_add(1);
            stats[1] = want;
            gave_up = true;
            break;
        }
        std::thread::sleep(EPOCH_NAP);
    }
    let held = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    stats[2] = stats[2].wrapping_add(held);
    stats[3] = stats[3].wrapping_add(1);
    Ok(gave_up)
}

/// What a stamp marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStamp {
    /// A wait starts: `stamps[0] = now`.
    Start,
    /// It ended: `stamps[1] += now - stamps[0]` (0 if `now` is earlier), `stamps[2] += 1`.
    End,
}

impl WaitStamp {
    /// The kernel's `mode`: 0 for [`WaitStamp::Start`], 1 for [`WaitStamp::End`].
    pub fn mode(self) -> i32 {
        match self {
            WaitStamp::Start => 0,
            WaitStamp::End => 1,
        }
    }

    /// The stamp of a kernel `mode` (0: start, anything else: end, as the kernel reads it).
    pub fn from_mode(mode: i32) -> Self {
        if mode == 0 {
            WaitStamp::Start
        } else {
            WaitStamp::End
        }
    }
}

/// `stamps` = `[start of the current wait, total waited, waits]`, in the clock's unit (ns);
/// `now` the clock. Wrapping adds, as the kernel's unsigned arithmetic.
///
/// # Errors
/// [`OasisError::Shape`] unless `stamps` has 3 elements.
pub fn wait_stamp(stamps: &mut [u64], stamp: WaitStamp, now: u64) -> Result<()> {
    if stamps.len() != 3 {
        return Err(OasisError::Shape {
            what: "stamps",
            expected: "[3]".into(),
            got: format!("[{}]", stamps.len()),
        });
    }
    match stamp {
        WaitStamp::Start => stamps[0] = now,
        WaitStamp::End => {
            stamps[1] = stamps[1].wrapping_add(now.saturating_sub(stamps[0]));
            stamps[2] = stamps[2].wrapping_add(1);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_add_up_and_count() {
        let mut s = [0u64; 3];
        wait_stamp(&mut s, WaitStamp::Start, 100).unwrap();
        wait_stamp(&mut s, WaitStamp::End, 130).unwrap();
        wait_stamp(&mut s, WaitStamp::Start, 200).unwrap();
        wait_stamp(&mut s, WaitStamp::End, 205).unwrap();
        assert_eq!(s, [200, 35, 2]);
        // A clock that went back counts no time, but the wait.
        wait_stamp(&mut s, WaitStamp::Start, 300).unwrap();
        wait_stamp(&mut s, WaitStamp::End, 250).unwrap();
        assert_eq!(s, [300, 35, 3]);
    }

    #[test]
    fn wait_epoch_returns_once_the_word_reaches_the_epoch_or_times_out() {
        let landed = std::sync::Arc::new(AtomicU64::new(3));
        let mut t = [0u64; 4];
        assert!(!wait_epoch(&landed, 3, Duration::ZERO, &mut t).unwrap());
        assert!(!wait_epoch(&landed, 2, Duration::ZERO, &mut t).unwrap());
        assert_eq!((t[0], t[3]), (0, 2));
        let w = std::sync::Arc::clone(&landed);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            w.store(4, Ordering::Release);
        });
        let t0 = Instant::now();
        assert!(!wait_epoch(&landed, 4, Duration::from_secs(5), &mut t).unwrap());
        assert!(t0.elapsed() >= Duration::from_millis(25));
        writer.join().unwrap();
        assert_eq!((t[0], t[1], t[3]), (0, 0, 3));
        assert!(t[2] >= 25_000_000, "{t:?}");
        let held = t[2];
        assert!(wait_epoch(&landed, 9, Duration::from_millis(10), &mut t).unwrap());
        assert_eq!((t[0], t[1], t[3]), (1, 9, 4));
        assert!(t[2] >= held + 10_000_000);
        assert!(wait_epoch(&landed, 9, Duration::from_millis(1), &mut [0u64; 2]).is_err());
    }

    #[test]
    fn modes_round_trip_and_a_bad_shape_is_refused() {
        for w in [WaitStamp::Start, WaitStamp::End] {
            assert_eq!(WaitStamp::from_mode(w.mode()), w);
        }
        assert_eq!(WaitStamp::from_mode(7), WaitStamp::End);
        assert!(wait_stamp(&mut [0u64; 2], WaitStamp::Start, 1).is_err());
    }
}
