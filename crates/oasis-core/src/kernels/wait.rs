//! CPU twin of `wait_stamp` (cuda/wait_stamp.cu): time a wait of the compute stream on
//! background work. The CPU path runs the background chain inline, so its waits are the two
//! calls' distance apart; the engine does not call it there, but the arithmetic is the kernel's.

use crate::error::{OasisError, Result};

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
    fn modes_round_trip_and_a_bad_shape_is_refused() {
        for w in [WaitStamp::Start, WaitStamp::End] {
            assert_eq!(WaitStamp::from_mode(w.mode()), w);
        }
        assert_eq!(WaitStamp::from_mode(7), WaitStamp::End);
        assert!(wait_stamp(&mut [0u64; 2], WaitStamp::Start, 1).is_err());
    }
}
