//! The tests of [`PresenceMap`](super::PresenceMap): examples, and every operation against a plain
//! model (a set of absent entries and a map of staged rows) under proptest.

use std::collections::{BTreeSet, HashMap, HashSet};

use proptest::prelude::*;

use super::*;

fn e(layer: u16, row: u32, head: u16) -> Entry {
    Entry { layer, row, head }
}

#[test]
fn marked_absent_again_a_staged_entry_is_read_again_and_a_local_one_is_not() {
    let mut m = PresenceMap::new(2, 2).unwrap();
    m.grow(3).unwrap();
    m.take_row(0, 4, 1).unwrap();
    m.mark_present(&[e(0, 0, ALL_HEADS), e(1, 0, ALL_HEADS)])
        .unwrap();
    assert_eq!(m.missing(), 0);
    // Row 2 holds no staged block: nothing to read, so it stays present.
    assert_eq!(
        m.mark_absent(&[e(0, 0, 1), e(0, 0, 1), e(1, 2, 0)])
            .unwrap(),
        1
    );
    assert_eq!(m.missing(), 1);
    assert_eq!(
        m.absent(&[e(0, 0, ALL_HEADS)], &HashSet::new()).unwrap(),
        vec![e(0, 0, 1)]
    );
    assert!(m.mark_absent(&[e(0, 0, ALL_HEADS)]).is_err());
    assert!(m.mark_absent(&[e(0, 5, 0)]).is_err());
    m.check_invariants().unwrap();
}

#[test]
fn a_staged_row_is_absent_until_read_and_reads_once() {
    let mut m = PresenceMap::new(2, 3).unwrap();
    m.grow(4).unwrap();
    assert_eq!(m.missing(), 0);
    m.take_row(1, 7, 5).unwrap();
    assert_eq!(m.missing(), 6);
    assert_eq!(m.owner_of(1).unwrap(), (7, 5));
    let keys = [e(0, 1, 2), e(0, 1, 2), e(1, 1, ALL_HEADS), e(0, 0, 1)];
    let got = m.absent(&keys, &HashSet::new()).unwrap();
    assert_eq!(got, vec![e(0, 1, 2), e(1, 1, 0), e(1, 1, 1), e(1, 1, 2)]);
    assert_eq!(m.mark_present(&got).unwrap(), vec![1, 1, 1, 1]);
    assert_eq!(m.missing(), 2);
    assert_eq!(m.mark_present(&[e(1, 1, ALL_HEADS)]).unwrap(), vec![0]);
    assert!(m.absent(&keys, &HashSet::new()).unwrap().is_empty());
    // A failed request's entries are never asked for.
    assert!(m
        .absent(&[e(0, 1, 0)], &HashSet::from([7]))
        .unwrap()
        .is_empty());
    assert_eq!(
        m.absent(&[e(0, 1, 0)], &HashSet::new()).unwrap(),
        vec![e(0, 1, 0)]
    );
    assert_eq!(m.forget_row(1).unwrap(), 4);
    assert_eq!(m.missing(), 0);
    assert_eq!(
        m.owner_of(1).unwrap().0,
        7,
        "an evicted row stays with its owner"
    );
    m.check_invariants().unwrap();
}

#[test]
fn growth_keeps_every_layers_entries() {
    let mut m = PresenceMap::new(3, 2).unwrap();
    m.grow(2).unwrap();
    m.take_row(1, 0, 9).unwrap();
    m.mark_present(&[e(2, 1, 1)]).unwrap();
    m.grow(5).unwrap();
    assert!(m.is_present(e(2, 1, 1)).unwrap());
    assert!(!m.is_present(e(2, 1, 0)).unwrap());
    assert!(!m.is_present(e(0, 1, 1)).unwrap());
    assert!(m.is_present(e(0, 4, 1)).unwrap());
    assert_eq!(m.missing(), 5);
    m.check_invariants().unwrap();
}

#[test]
fn bad_keys_and_rows_are_refused_and_change_nothing() {
    let mut m = PresenceMap::new(2, 2).unwrap();
    m.grow(2).unwrap();
    m.take_row(0, 3, 0).unwrap();
    let before = m.clone();
    assert!(m.mark_present(&[e(0, 0, 0), e(2, 0, 0)]).is_err());
    assert!(m.mark_present(&[e(0, 0, 0), e(0, 2, 0)]).is_err());
    assert!(m.mark_present(&[e(0, 0, 2)]).is_err());
    assert!(m.is_present(e(0, 0, ALL_HEADS)).is_err());
    assert!(m.release(&[0, 5]).is_err());
    assert!(m.take_row(0, 4, 1).is_err(), "a row holding a staged block");
    assert!(m.take_row(1, -1, 1).is_err());
    assert!(m.set_owner(0, 4).is_err());
    assert_eq!(m, before);
    assert!(PresenceMap::new(0, 1).is_err() && PresenceMap::new(1, 0).is_err());
    assert!(PresenceMap::new(1, usize::from(ALL_HEADS)).is_err());
}

/// The plain model: staged rows -> (owner, logical), absent entries, owners of every row.
#[derive(Default)]
struct Model {
    rows: usize,
    owner: HashMap<u32, i64>,
    staged: HashMap<u32, u32>,
    absent: BTreeSet<(u16, u32, u16)>,
}

#[derive(Debug, Clone)]
enum Op {
    Grow(usize),
    Take(u32, i64, u32),
    Forget(u32),
    Release(Vec<u32>),
    Mark(Vec<(u16, u32, u16)>),
    Absent(Vec<(u16, u32, u16)>, Vec<i64>),
    SetOwner(u32, i64),
}

const L: u16 = 3;
const H: u16 = 2;

fn key() -> impl Strategy<Value = (u16, u32, u16)> {
    (0..L + 1, 0u32..14, prop_oneof![0..H + 1, Just(ALL_HEADS)])
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..14).prop_map(Op::Grow),
        (0u32..14, -1i64..4, 0u32..50).prop_map(|(r, o, l)| Op::Take(r, o, l)),
        (0u32..14).prop_map(Op::Forget),
        prop::collection::vec(0u32..14, 0..4).prop_map(Op::Release),
        prop::collection::vec(key(), 0..8).prop_map(Op::Mark),
        (
            prop::collection::vec(key(), 0..8),
            prop::collection::vec(0i64..4, 0..2)
        )
            .prop_map(|(k, f)| Op::Absent(k, f)),
        (0u32..14, -1i64..4).prop_map(|(r, o)| Op::SetOwner(r, o)),
    ]
}

fn expand(k: (u16, u32, u16)) -> Vec<(u16, u32, u16)> {
    if k.2 == ALL_HEADS {
        (0..H).map(|h| (k.0, k.1, h)).collect()
    } else {
        vec![k]
    }
}

impl Model {
    fn key_ok(&self, k: (u16, u32, u16)) -> bool {
        k.0 < L && (k.1 as usize) < self.rows && (k.2 < H || k.2 == ALL_HEADS)
    }

    fn clear(&mut self, row: u32) -> u64 {
        if self.staged.remove(&row).is_none() {
            return 0;
        }
        let gone = self.absent.iter().filter(|k| k.1 == row).count() as u64;
        self.absent.retain(|k| k.1 != row);
        u64::from(L) * u64::from(H) - gone
    }
}

proptest! {
    #[test]
    fn every_operation_matches_the_plain_model(ops in prop::collection::vec(op(), 1..60)) {
        let mut m = PresenceMap::new(L.into(), H.into()).unwrap();
        let mut model = Model::default();
        for op in ops {
            let before = m.clone();
            match op {
                Op::Grow(n) => {
                    m.grow(n).unwrap();
                    model.rows = model.rows.max(n);
                }
                Op::Take(r, o, l) => {
                    let ok = (r as usize) < model.rows && o >= 0 && !model.staged.contains_key(&r);
                    prop_assert_eq!(m.take_row(r, o, l).is_ok(), ok);
                    if ok {
                        model.owner.insert(r, o);
                        model.staged.insert(r, l);
                        for layer in 0..L {
                            for h in 0..H {
                                model.absent.insert((layer, r, h));
                            }
                        }
                        prop_assert_eq!(m.owner_of(r).unwrap(), (o, l));
                    }
                }
                Op::Forget(r) => {
                    let got = m.forget_row(r);
                    prop_assert_eq!(got.is_ok(), (r as usize) < model.rows);
                    if let Ok(had) = got {
                        prop_assert_eq!(had, model.clear(r));
                    }
                }
                Op::Release(rows) => {
                    let ok = rows.iter().all(|&r| (r as usize) < model.rows);
                    let got = m.release(&rows);
                    prop_assert_eq!(got.is_ok(), ok);
                    if let Ok(had) = got {
                        let mut want = 0;
                        for r in rows {
                            want += model.clear(r);
                            model.owner.remove(&r);
                        }
                        prop_assert_eq!(had, want);
                    }
                }
                Op::Mark(keys) => {
                    let ok = keys.iter().all(|&k| model.key_ok(k));
                    let entries: Vec<Entry> = keys.iter().map(|&(l, r, h)| e(l, r, h)).collect();
                    let got = m.mark_present(&entries);
                    prop_assert_eq!(got.is_ok(), ok);
                    if let Ok(news) = got {
                        for (k, new) in keys.into_iter().zip(news) {
                            let n = expand(k).into_iter().filter(|x| model.absent.remove(x)).count();
                            prop_assert_eq!(new as usize, n);
                        }
                    }
                }
                Op::Absent(keys, failed) => {
                    let ok = keys.iter().all(|&k| model.key_ok(k));
                    let entries: Vec<Entry> = keys.iter().map(|&(l, r, h)| e(l, r, h)).collect();
                    let failed: HashSet<i64> = failed.into_iter().collect();
                    let got = m.absent(&entries, &failed);
                    prop_assert_eq!(got.is_ok(), ok);
                    if let Ok(got) = got {
                        let want: BTreeSet<(u16, u32, u16)> = keys
                            .into_iter()
                            .flat_map(expand)
                            .filter(|x| model.absent.contains(x))
                            .filter(|x| !failed.contains(&model.owner[&x.1]))
                            .collect();
                        let got: Vec<(u16, u32, u16)> = got.iter().map(|x| (x.layer, x.row, x.head)).collect();
                        prop_assert_eq!(got, want.into_iter().collect::<Vec<_>>());
                    }
                }
                Op::SetOwner(r, o) => {
                    let ok = (r as usize) < model.rows && !model.staged.contains_key(&r);
                    prop_assert_eq!(m.set_owner(r, o).is_ok(), ok);
                    if ok {
                        model.owner.insert(r, o);
                    }
                }
            }
            if m.check_invariants().is_err() {
                prop_assert!(false, "invariants broken after an op (before: {:?})", before.missing());
            }
            prop_assert_eq!(m.missing(), model.absent.len() as u64);
            prop_assert_eq!(m.shape().1, model.rows);
        }
    }
}
