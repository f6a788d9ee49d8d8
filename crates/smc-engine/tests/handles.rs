//! Connection handles are generational: once a connection is freed, its
//! handle reaches nothing, also after a new connection took its slot. A
//! program that keeps a handle too long (a late epoll event, a socket
//! dropped twice, a timer) must not read, write or close someone else's
//! connection.

use smc_engine::endpoint::{ConnError, ConnId, ConnStatus};
use std::time::Duration;

mod common;

use common::World;

#[test]
fn a_freed_connections_handle_does_not_reach_the_connection_in_its_slot() {
    let mut w = World::default();
    let mut old = w.handshake();
    w.client.write(old.c, b"old").unwrap();
    w.settle(&mut [&mut old], Duration::from_millis(1));
    assert_eq!(w.server.read(old.s, 100).unwrap(), b"old");
    w.client.release(old.c);
    w.server.release(old.s);
    w.settle(&mut [&mut old], Duration::from_millis(5));
    assert_eq!(
        (w.client.connections(), w.server.connections()),
        (0, 0),
        "both ends freed the connection"
    );

    let mut new = w.handshake();
    assert_eq!(w.client.status(new.c), Some(ConnStatus::Smc));
    assert_eq!(
        new.c.slot(),
        old.c.slot(),
        "the new connection took the slot"
    );
    assert_eq!(new.s.slot(), old.s.slot());
    assert_ne!(new.c, old.c);
    assert_ne!(ConnId::from_bits(new.c.to_bits()), old.c);

    // the old handle finds nothing ...
    assert_eq!(w.client.status(old.c), None);
    assert_eq!(w.client.alert_token(old.c), None);
    assert_eq!(
        w.client.write(old.c, b"stray"),
        Err(ConnError::NotConnected)
    );
    assert_eq!(w.server.read(old.s, 100), Err(ConnError::NotConnected));
    // ... and what it is given to do does not happen to the new connection
    assert!(!w.client.tcp_closed(old.c));
    w.client.release(old.c);
    w.server.release(old.s);
    w.settle(&mut [&mut new], Duration::from_millis(5));
    assert_eq!(w.client.status(new.c), Some(ConnStatus::Smc));
    assert_eq!(w.server.status(new.s), Some(ConnStatus::Smc));
    w.client.write(new.c, b"new").unwrap();
    w.settle(&mut [&mut new], Duration::from_millis(1));
    assert_eq!(w.server.read(new.s, 100).unwrap(), b"new");
}
