//! Receiving: the receive completions of a link, each message dispatched by
//! its type byte — LLC to the link group, a CDC to the connection whose alert
//! token it carries, whatever link it came on — and a CDC applied to its
//! connection: cursors, urgent byte, close flags, violations.
//!
//! Spec: `protocol-llc-cdc.md` §0 (framing), §2 (CDC messages, §2.3 sequence
//! numbers, §2.4 failover validation), §3.4 (receive side), §3.5 (urgent
//! data), §4.2 (per-link receive side), §9. Linux: smc_wr.c
//! (`smc_wr_rx_tasklet_fn`), smc_cdc.c (`smc_cdc_rx_handler`,
//! `smc_cdc_msg_recv`).

use super::conn::Phase;
use super::conn_core::{lock, CdcDone, TokenTable};
use super::link::{LeftMsg, LinkRx, Recv, RxBook, RxLeft};
use super::{ConnId, Endpoint, LgrId, Result};
use smc_proto::Timestamp;
use smc_rdma::{Provider, WcStatus};
use smc_wire::cdc::CdcMessage;
use smc_wire::WrMessage;

/// CDCs kept per connection while its CLC Confirm is still on the way.
pub(super) const EARLY_CDC_MAX: usize = 64;

impl<P: Provider> Endpoint<P> {
    /// Receive completions of link `slot`: LLC to the link group (as arrived on
    /// that link), CDCs to the connection of their token, whatever link they
    /// came on (§9). Polled under the link's receive lock (`LinkRx`), held
    /// for the whole poll, so that what the CQ gives is handled in its order:
    /// first what a dispatch without the device lock left ([`dispatch`]),
    /// then the CQ.
    pub(super) fn poll_recv(&mut self, l: LgrId, slot: usize, now: Timestamp) -> Result<()> {
        let Some(rx) = self
            .lgrs
            .get(l)
            .and_then(|lg| lg.links.get(slot))
            .and_then(Option::as_ref)
            .map(|res| res.rx.clone())
        else {
            return Ok(());
        };
        let mut book = rx.book();
        if rx.attention() {
            rx.set_attention(&book, false);
            self.completions += std::mem::take(&mut book.completions);
            let cdcs = rx.cdcs.take(&*book);
            self.cdc_received += cdcs;
            self.cdc_dispatched += cdcs;
            if std::mem::take(&mut book.active) {
                if let Some(lg) = self.lgrs.get_mut(l) {
                    lg.group.on_rx_activity(slot, now);
                }
            }
            let mut marks = std::mem::take(&mut book.marks);
            for &id in &marks {
                self.mark_tx(id);
            }
            marks.clear();
            book.marks = marks;
            while let Some(left) = book.queue.pop_front() {
                match left {
                    RxLeft::Wc(wc) => {
                        self.completions += 1;
                        let r = Recv {
                            wc,
                            in_place: false,
                        };
                        if !self.on_recv(l, slot, now, &rx, &mut book, r)? {
                            return Ok(());
                        }
                    }
                    RxLeft::Msg(wc, msg) => {
                        self.completions += 1;
                        let msg = msg.bytes();
                        let n = msg.len();
                        if book.msg.len() < n {
                            book.msg.resize(n, 0);
                        }
                        book.msg[..n].copy_from_slice(msg);
                        let r = Recv {
                            wc: smc_rdma::WorkCompletion {
                                byte_len: n as u32,
                                ..wc
                            },
                            in_place: true,
                        };
                        if !self.on_recv(l, slot, now, &rx, &mut book, r)? {
                            return Ok(());
                        }
                    }
                    RxLeft::Done(id, done) => self.cdc_applied(id, done),
                    RxLeft::Repost(e) => self.link_error(l, slot, e)?,
                }
            }
        }
        while let Some(r) = rx.next(&mut book)? {
            self.completions += 1;
            if !self.on_recv(l, slot, now, &rx, &mut book, r)? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Receive `r` of link `slot` of group `l` (the caller holds its
    /// receive lock, `book`); `false` when the link or group is gone.
    fn on_recv(
        &mut self,
        l: LgrId,
        slot: usize,
        now: Timestamp,
        rx: &LinkRx<P>,
        book: &mut RxBook,
        r: Recv,
    ) -> Result<bool> {
        let wc = r.wc;
        let Some(lg) = self.lgrs.get_mut(l) else {
            return Ok(false);
        };
        if lg.links.get(slot).and_then(Option::as_ref).is_none() {
            return Ok(false);
        }
        if wc.status != WcStatus::Success {
            if wc.status != WcStatus::WrFlushError {
                lg.group.on_link_failure(slot);
            }
            return Ok(true);
        }
        let len = rx.message(book, &r)?;
        let reposted = rx.release(book, &r);
        lg.group.on_rx_activity(slot, now);
        match WrMessage::decode(&book.msg[..len]) {
            Ok(WrMessage::Llc(m)) => {
                self.llc_received += 1;
                lg.group.on_llc(slot, m, now);
                // (an LLC flow may have started or moved its deadline)
                self.lgr_recheck = true;
            }
            Ok(WrMessage::Cdc(c)) => {
                self.cdc_received += 1;
                // The CDC carries the receiver's alert token (§2.1), of a
                // connection of this link's group. A failover validation
                // that claims more than this side processed is held: what
                // it claims may wait on another link of the group, one
                // polled before it came (see `settle_validations`).
                // (`Some(None)`: held)
                let found = {
                    let table = self.by_token.read();
                    table.get(&c.token).filter(|e| e.lgr == l).map(|e| {
                        let mut k = lock(&e.core);
                        if k.dp.as_ref().is_some_and(|dp| dp.validation_shows_loss(&c)) {
                            return None;
                        }
                        Some((e.id, k.dp.is_some().then(|| k.on_cdc(&c))))
                    })
                };
                match found {
                    Some(Some((id, done))) => self.cdc_done(id, &c, done),
                    Some(None) => self.held_validations.push((l, c)),
                    None => lg.group.dropped += 1,
                }
            }
            Err(_) => lg.group.dropped += 1,
        }
        if let Err(e) = reposted {
            self.link_error(l, slot, e)?;
        }
        Ok(true)
    }

    /// The failover validations of group `l` held by [`Self::on_recv`],
    /// judged now that the group's links are polled again. The peer sends
    /// one after it saw its last CDCs over the failed link complete (Linux:
    /// smc_cdc.c `smcr_cdc_msg_send_validation`, seqno `tx_cdc_seq_fin`), so
    /// those CDCs are in this side's receive queue of that link (an RC
    /// send completes once the responder has it) or were taken already:
    /// if one was polled before the validation came on another link,
    /// polling every link again takes them, and only then does a claim
    /// beyond what was processed show loss (`Violation::OutOfSync`, abort;
    /// smc_cdc.c `smc_cdc_msg_validate`). Validations that polling brings
    /// in are held until the next call.
    pub(super) fn settle_validations(&mut self, l: LgrId, now: Timestamp) -> Result<()> {
        if !self.holds_validations(l) {
            return Ok(());
        }
        let mut held = Vec::new();
        self.held_validations.retain(|h| {
            let ours = h.0 == l;
            if ours {
                held.push(h.1);
            }
            !ours
        });
        for slot in 0..smc_proto::link::LINK_SLOTS {
            self.poll_recv(l, slot, now)?;
        }
        for m in held {
            let id = {
                let table = self.by_token.read();
                table.get(&m.token).filter(|e| e.lgr == l).map(|e| e.id)
            };
            if let Some(id) = id {
                self.on_cdc(id, &m);
            }
        }
        Ok(())
    }

    /// Whether group `l` holds a failover validation (`settle_validations`).
    pub(super) fn holds_validations(&self, l: LgrId) -> bool {
        self.held_validations.iter().any(|h| h.0 == l)
    }

    /// Applies the peer's CDC `m` to connection `id` (found by its id; the
    /// receive loop above finds the core by the CDC's token instead).
    pub(super) fn on_cdc(&mut self, id: ConnId, m: &CdcMessage) {
        let done = self
            .core(id)
            .and_then(|mut k| k.dp.is_some().then(|| k.on_cdc(m)));
        self.cdc_done(id, m, done);
    }

    /// What follows a CDC for connection `id`: `done`, what its data path
    /// made of it (see `ConnCore::on_cdc`), or `None` when it has none yet
    /// and the CDC is kept for it (see `Phase::AwaitConfirm`).
    fn cdc_done(&mut self, id: ConnId, m: &CdcMessage, done: Option<CdcDone>) {
        self.mark_tx(id);
        let Some(done) = done else {
            let Some(c) = self.conn(id) else { return };
            if let Phase::ServerRkey { early, .. } | Phase::AwaitConfirm { early, .. } =
                &mut c.phase
            {
                if early.len() >= EARLY_CDC_MAX {
                    // Cursors are cumulative, so an older CDC can go, but not
                    // one that says its last byte is urgent: no later CDC
                    // names that byte again (urg_data_present, §3.5; Linux
                    // `smc_cdc_msg_recv_action` takes it from that CDC alone).
                    let old = early
                        .iter()
                        .position(|e| !e.prod_flags.urg_data_present())
                        .unwrap_or(0);
                    early.remove(old);
                }
                early.push_back(*m);
            }
            return;
        };
        self.cdc_applied(id, done);
    }

    /// What the endpoint does after a CDC applied to connection `id` left
    /// `done` (the flush mark aside).
    fn cdc_applied(&mut self, id: ConnId, done: CdcDone) {
        if let Some(cause) = done.aborted {
            self.event_aborted(id, cause);
        }
        // the peer's close may have been the last step: it may be freed
        if done.finished {
            self.conn_due(id);
        }
    }
}

/// Receive dispatch without the device lock (docs/FAST-PATH.md, step 4):
/// polls the receive CQ of link `rx` (of group `l`), if no other poller has
/// it and the endpoint has taken everything an earlier dispatch left, and
/// applies the CDCs it finds to their connections (found in `tokens`), as
/// the endpoint's own poll does; whatever else it finds (LLC, a failed
/// completion, a CDC of an unknown token, of another group or of a
/// connection not yet established), and everything after it, is left in
/// the link's queue for the endpoint (`RxBook::queue`), with the flush
/// marks and the link's activity. Whether it applied a CDC.
///
/// Linux does the same in its receive tasklet (smc_wr.c
/// `smc_wr_rx_tasklet_fn`, smc_cdc.c `smc_cdc_rx_handler`) under no
/// socket-wide lock.
pub(super) fn dispatch<P: Provider>(rx: &LinkRx<P>, tokens: &TokenTable<P>, l: LgrId) -> bool {
    dispatch_inner(rx, tokens, l).is_some_and(|(applied, _)| applied)
}

/// [`dispatch`] for a reader about to sleep (`FastConn::may_sleep`):
/// `None` if it could not poll (another poller has the link's lock), else
/// whether the poll left the link's queue empty (nothing for the endpoint;
/// false also when the endpoint had not taken an earlier dispatch's or
/// the link is closed to connections).
pub(super) fn dispatch_all<P: Provider>(
    rx: &LinkRx<P>,
    tokens: &TokenTable<P>,
    l: LgrId,
) -> Option<bool> {
    let mut clean = false;
    let ran = dispatch_with(rx, tokens, l, &mut clean);
    ran.map(|_| clean)
}

fn dispatch_inner<P: Provider>(
    rx: &LinkRx<P>,
    tokens: &TokenTable<P>,
    l: LgrId,
) -> Option<(bool, bool)> {
    let mut clean = false;
    dispatch_with(rx, tokens, l, &mut clean).map(|a| (a, clean))
}

/// The poll of [`dispatch`]: `None` if the link's lock was taken; else
/// whether it applied a CDC, `clean` set when it left the queue empty.
fn dispatch_with<P: Provider>(
    rx: &LinkRx<P>,
    tokens: &TokenTable<P>,
    l: LgrId,
    clean: &mut bool,
) -> Option<bool> {
    let mut book = rx.try_book()?;
    // (open looked at again under the lock: a link going down is closed,
    // then polled a last time by the endpoint, `on_link_down`)
    if !book.queue.is_empty() || !rx.is_open() {
        return Some(false);
    }
    // Nothing new on the link: what the poll below would conclude, without
    // it (the attention it would leave is what the book says already).
    if rx.quiet(&book) {
        rx.note_polled();
        let left = book.leaves_work();
        if rx.attention() != left {
            rx.set_attention(&book, left);
        }
        *clean = true;
        return Some(false);
    }
    // Set before the poll: a pump that looks at the link without its lock
    // (`lgr_quiet`) and finds the CQ emptied by this poll sees it, pumps the
    // group, and waits for the lock (a leader about to sleep would
    // otherwise miss what this dispatch leaves).
    rx.set_attention(&book, true);
    rx.note_polled();
    let mut applied = false;
    // Once something is left to the endpoint, the rest is too: it stays
    // where it is (the last poll's completions in `book`, the CQ, the
    // ring), for the endpoint's poll to take after the queue. (A failed
    // poll: the endpoint's poll meets it again.)
    while book.queue.is_empty() {
        let Ok(Some(r)) = rx.next(&mut book) else {
            break;
        };
        let wc = r.wc;
        // What is left to the endpoint: a completion as it is, a message
        // taken in place with its bytes.
        let leave = |book: &mut RxBook| {
            let left = if r.in_place {
                let n = (wc.byte_len as usize).min(book.msg.len());
                RxLeft::Msg(wc, LeftMsg::new(&book.msg[..n]))
            } else {
                RxLeft::Wc(wc)
            };
            book.queue.push_back(left);
        };
        if wc.status != WcStatus::Success {
            leave(&mut book);
            continue;
        }
        let Ok(len) = rx.message(&mut book, &r) else {
            leave(&mut book);
            continue;
        };
        // (a CDC decoded as such, not as a `WrMessage`: LLC is left)
        let msg = &book.msg[..len];
        let cdc = msg.first() == Some(&smc_wire::cdc::CDC_TYPE);
        // (a failover validation is the endpoint's to judge: it may have to
        // poll the group's other links first, `settle_validations`)
        let Some(c) = cdc
            .then(|| CdcMessage::decode(msg).ok())
            .flatten()
            .filter(|c| !c.is_failover_validation())
        else {
            leave(&mut book);
            continue;
        };
        let found = {
            let table = tokens.read();
            table.get(&c.token).filter(|e| e.lgr == l).and_then(|e| {
                let mut k = lock(&e.core);
                (k.dp.is_some() && k.established).then(|| (e.id, k.on_cdc(&c)))
            })
        };
        let Some((id, done)) = found else {
            leave(&mut book);
            continue;
        };
        applied = true;
        book.completions += 1;
        rx.cdcs.add(&*book);
        book.active = true;
        if !book.marks.contains(&id) {
            book.marks.push(id);
        }
        if done.aborted.is_some() || done.finished {
            book.queue.push_back(RxLeft::Done(id, done));
        }
        if let Err(e) = rx.release(&book, &r) {
            book.queue.push_back(RxLeft::Repost(e));
        }
        // (what `next` would say without looking: the poll saw no more)
        if book.nothing_left() {
            break;
        }
    }
    rx.set_attention(&book, book.leaves_work());
    *clean = book.queue.is_empty();
    Some(applied)
}
