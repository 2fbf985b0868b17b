//! The responses a lane is waiting for, read from the socket in as few reads as possible.
//!
//! A lane pipelines requests, so several responses are usually on their way at once. Reading
//! them one by one (a status, then a READ's data, then the next status, ...) costs a system call
//! per part and a wake-up per block. [`Responses`] lays every expected part of every waiting
//! response out as one vectored read instead: the status of each (v2), then, for a READ, its
//! data straight into its destination; and it knows how many bytes are still to come, so the
//! reader may ask the kernel to wake it only once a good part of them is there.
//!
//! That layout assumes each status is OK. A rejected READ has no data after its status, so the
//! bytes read past a rejected status belong to the responses after it: they are moved into a
//! carry buffer, the later responses are laid out again, and the carry fills them before the
//! socket is read again. The rejected READ's destination may then hold bytes of later responses
//! (a failed READ's destination is unspecified, as after a lost connection).

use std::collections::VecDeque;
use std::io::IoSliceMut;

use crate::wire::{STATUS_LEN, Status, WireError};

/// What a waiting response reads its data into.
pub(crate) trait Destination {
    /// The destination of the response's data: a READ's local range, empty for anything else.
    /// `None` when the range cannot be reached (the request is failed instead of read).
    fn data(&mut self) -> Option<&mut [u8]>;
}

/// How a peer answered one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Served (a READ's data is in its destination).
    Ok,
    /// Refused: outside the peer's registered memory. Nothing else of it came.
    Rejected,
}

/// One waiting response.
struct Waiting<T> {
    item: T,
    /// The status as read so far (v2 only).
    status: [u8; STATUS_LEN],
    /// Bytes of this response read so far: its status first, then its data.
    got: usize,
    /// The data's length when the status is OK.
    data_len: usize,
}

/// The responses one connection waits for, in request order (see the module documentation).
pub(crate) struct Responses<T> {
    queue: VecDeque<Waiting<T>>,
    /// Bytes still expected for the waiting responses (their statuses all OK).
    expected: usize,
    /// Bytes read past a rejected status, for the responses after it.
    carry: Vec<u8>,
    /// Responses carry a status (v2 framing).
    v2: bool,
}

impl<T: Destination> Responses<T> {
    /// Nothing waiting yet; `v2` when the peer answers each request with a status.
    pub(crate) fn new(v2: bool) -> Self {
        Self { queue: VecDeque::new(), expected: 0, carry: Vec::new(), v2 }
    }

    fn status_len(&self) -> usize {
        if self.v2 { STATUS_LEN } else { 0 }
    }

    /// Waits for `item`'s response after the ones already waiting; gives `item` back when its
    /// destination cannot be reached.
    pub(crate) fn push(&mut self, mut item: T) -> Result<(), T> {
        let Some(data_len) = item.data().map(|d| d.len()) else { return Err(item) };
        self.expected += self.status_len() + data_len;
        self.queue.push_back(Waiting { item, status: [0; STATUS_LEN], got: 0, data_len });
        Ok(())
    }

    /// Responses waiting.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when no response is waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Bytes still expected for the waiting responses (their statuses all OK).
    pub(crate) fn expected(&self) -> usize {
        self.expected
    }

    /// Bytes certain to come whatever the peer answers: every waiting response's status (v2),
    /// and the data of the first one once its status said OK ([`next_done`](Self::next_done)
    /// took a rejected one away already). Without statuses (v1) nothing is rejected: all of it.
    pub(crate) fn certain(&self) -> usize {
        let status_len = self.status_len();
        if !self.v2 {
            return self.expected();
        }
        let statuses: usize = self.queue.iter().map(|w| status_len - w.got.min(status_len)).sum();
        let front_data = match self.queue.front() {
            Some(f) if f.got >= status_len => status_len + f.data_len - f.got,
            _ => 0,
        };
        statuses + front_data
    }

    /// True when bytes read earlier wait to be placed ([`fill_from_carry`](Self::fill_from_carry)
    /// before reading the socket again).
    pub(crate) fn has_carry(&self) -> bool {
        !self.carry.is_empty()
    }

    /// The waiting items, in order.
    pub(crate) fn items(&self) -> impl Iterator<Item = &T> {
        self.queue.iter().map(|w| &w.item)
    }

    /// Gives every waiting item back, in order (the connection failed).
    pub(crate) fn into_items(self) -> impl Iterator<Item = T> {
        self.queue.into_iter().map(|w| w.item)
    }

    /// Where the next bytes of the stream go, in order: what remains of each waiting response.
    pub(crate) fn slices(&mut self) -> Vec<IoSliceMut<'_>> {
        let status_len = self.status_len();
        let mut out = Vec::with_capacity(self.queue.len() * 2);
        for w in self.queue.iter_mut() {
            if w.got < status_len {
                out.push(IoSliceMut::new(&mut w.status[w.got..status_len]));
            }
            let from = w.got.saturating_sub(status_len);
            if let Some(data) = w.item.data()
                && from < data.len()
            {
                out.push(IoSliceMut::new(&mut data[from..]));
            }
        }
        out
    }

    /// Accounts for `n` bytes just read into [`slices`](Self::slices).
    pub(crate) fn advance(&mut self, mut n: usize) {
        self.expected -= n.min(self.expected);
        let status_len = self.status_len();
        for w in self.queue.iter_mut() {
            if n == 0 {
                break;
            }
            let take = (status_len + w.data_len - w.got).min(n);
            w.got += take;
            n -= take;
        }
        debug_assert_eq!(n, 0, "more bytes accounted than were laid out");
    }

    /// Places carried bytes (read past a rejected status) into the waiting responses; the bytes
    /// placed.
    pub(crate) fn fill_from_carry(&mut self) -> usize {
        let carry = std::mem::take(&mut self.carry);
        let mut placed = 0;
        for mut s in self.slices() {
            if placed == carry.len() {
                break;
            }
            let n = s.len().min(carry.len() - placed);
            s[..n].copy_from_slice(&carry[placed..placed + n]);
            placed += n;
        }
        self.advance(placed);
        self.carry = carry[placed..].to_vec();
        placed
    }

    /// The first waiting response once it is complete, with the peer's answer; `Ok(None)` while
    /// its bytes are still coming. A status that is not one is an error (the connection is out
    /// of step).
    pub(crate) fn next_done(&mut self) -> Result<Option<(T, Answer)>, WireError> {
        let status_len = self.status_len();
        let Some(front) = self.queue.front() else { return Ok(None) };
        if front.got < status_len {
            return Ok(None);
        }
        if self.v2 && Status::decode(&front.status)? == Status::Rejected {
            self.unplace_after_rejected();
            let w = self.queue.pop_front().expect("a front response");
            return Ok(Some((w.item, Answer::Rejected)));
        }
        if front.got < status_len + front.data_len {
            return Ok(None);
        }
        let w = self.queue.pop_front().expect("a front response");
        Ok(Some((w.item, Answer::Ok)))
    }

    /// The first response was rejected: it ends at its status. Whatever was read past it (into
    /// its own destination and into the later responses) is taken back into the carry, ahead of
    /// what the carry held, and the later responses start over.
    fn unplace_after_rejected(&mut self) {
        let status_len = self.status_len();
        let mut taken = Vec::new();
        let mut queue = self.queue.iter_mut();
        if let Some(front) = queue.next() {
            let past = front.got - status_len;
            if past > 0
                && let Some(data) = front.item.data()
            {
                taken.extend_from_slice(&data[..past]);
            }
            front.got = status_len;
            front.data_len = 0;
        }
        for w in queue {
            let in_status = w.got.min(status_len);
            taken.extend_from_slice(&w.status[..in_status]);
            let in_data = w.got - in_status;
            if in_data > 0
                && let Some(data) = w.item.data()
            {
                taken.extend_from_slice(&data[..in_data]);
            }
            w.got = 0;
        }
        taken.extend_from_slice(&self.carry);
        self.carry = taken;
        self.expected = self.queue.iter().map(|w| status_len + w.data_len - w.got).sum();
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A test response: its number and destination.
    #[derive(Debug)]
    struct Expect {
        id: usize,
        dst: Vec<u8>,
    }

    impl Destination for Expect {
        fn data(&mut self) -> Option<&mut [u8]> {
            Some(&mut self.dst)
        }
    }

    /// What the peer sends for each request (`(rejected, data length when served)`), and the
    /// data of each.
    fn stream(answers: &[(bool, usize)], v2: bool) -> (Vec<u8>, Vec<Vec<u8>>) {
        let mut bytes = Vec::new();
        let mut datas = Vec::new();
        for (i, &(rejected, len)) in answers.iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|b| (i * 31 + b * 7) as u8).collect();
            if v2 {
                bytes.extend_from_slice(&if rejected { Status::Rejected } else { Status::Ok }.encode());
            }
            if !rejected {
                bytes.extend_from_slice(&data);
            }
            datas.push(data);
        }
        (bytes, datas)
    }

    /// Feeds `bytes` in reads of the given sizes (cycled), keeping up to `gather` responses
    /// waiting as a lane does; the answers and destinations, in completion order.
    fn receive(
        answers: &[(bool, usize)],
        v2: bool,
        bytes: &[u8],
        reads: &[usize],
        gather: usize,
    ) -> Vec<(usize, Answer, Vec<u8>)> {
        let mut r = Responses::new(v2);
        let (mut next, mut at, mut k) = (0, 0, 0);
        let mut done = Vec::new();
        while done.len() < answers.len() {
            while next < answers.len() && r.len() < gather {
                r.push(Expect { id: next, dst: vec![0xEE; answers[next].1] }).unwrap();
                next += 1;
            }
            let recount: usize = r.queue.iter().map(|w| r.status_len() + w.data_len - w.got).sum();
            assert_eq!(r.expected(), recount, "the running count of expected bytes drifted");
            // What is certain to come is never more than what the stream still holds (a reader
            // waits for it without a bound); the carry's bytes came already.
            assert!(r.has_carry() || r.certain() <= bytes.len() - at, "more bytes counted as certain than will come");
            if r.has_carry() {
                r.fill_from_carry();
            } else {
                let want = reads[k % reads.len()].max(1);
                k += 1;
                let mut n = 0;
                for mut s in r.slices() {
                    let m = s.len().min(want - n).min(bytes.len() - at - n);
                    s[..m].copy_from_slice(&bytes[at + n..at + n + m]);
                    n += m;
                }
                assert!(n > 0 || r.expected() == 0, "the layout stalled with bytes left");
                at += n;
                r.advance(n);
            }
            while let Some((e, answer)) = r.next_done().unwrap() {
                done.push((e.id, answer, e.dst));
            }
        }
        assert_eq!(at, bytes.len(), "every byte of the stream was placed");
        assert!(!r.has_carry());
        done
    }

    proptest! {
        /// Whatever the read sizes, how many responses wait at once and where the rejections
        /// fall: every response completes in order, with its answer, and a served READ's
        /// destination holds exactly its data.
        #[test]
        fn responses_are_placed_exactly_whatever_the_reads(
            answers in prop::collection::vec((prop::bool::weighted(0.25), 0usize..300), 1..24),
            reads in prop::collection::vec(1usize..700, 1..8),
            gather in 1usize..10,
            v2 in any::<bool>(),
        ) {
            // v1 has no status, so nothing is rejected.
            let answers: Vec<(bool, usize)> = answers.into_iter().map(|(rej, len)| (rej && v2, len)).collect();
            let (bytes, datas) = stream(&answers, v2);
            let done = receive(&answers, v2, &bytes, &reads, gather);
            prop_assert_eq!(done.len(), answers.len());
            for (i, (id, answer, dst)) in done.into_iter().enumerate() {
                prop_assert_eq!(id, i);
                if answers[i].0 {
                    prop_assert_eq!(answer, Answer::Rejected);
                } else {
                    prop_assert_eq!(answer, Answer::Ok);
                    prop_assert_eq!(&dst, &datas[i]);
                }
            }
        }
    }

    #[test]
    fn a_bad_status_is_an_error() {
        let mut r = Responses::new(true);
        r.push(Expect { id: 0, dst: vec![0; 4] }).unwrap();
        r.slices()[0].copy_from_slice(&[0xFF; STATUS_LEN]);
        r.advance(STATUS_LEN);
        assert!(r.next_done().is_err());
    }

    #[test]
    fn one_read_lays_out_every_waiting_response() {
        let mut r = Responses::new(true);
        for id in 0..3 {
            r.push(Expect { id, dst: vec![0; 100] }).unwrap();
        }
        // Three statuses and three destinations, in order.
        assert_eq!(r.slices().iter().map(|s| s.len()).collect::<Vec<_>>(), [8, 100, 8, 100, 8, 100]);
        assert_eq!(r.expected(), 324);
        // Only the statuses are certain to come: each may say "rejected", with no data after.
        assert_eq!(r.certain(), 24);
    }
}
