//! Servers whose processes run as ordinary users, as a distribution starts
//! them, with the rendezvous opened to users by its install. Opening it
//! changes the host's access: `OpenToUsers` holds the binary's `ADMIN` lock,
//! so these tests run one at a time (and cargo runs test binaries one after
//! the other).

mod common;

use common::*;

/// redis-server as the `redis` user (Debian's service), the rendezvous
/// opened to users by its install: every connection SMC-R.
#[test]
fn redis_server_as_an_ordinary_user_over_smc_r() {
    let s = redis_as("redis-user", true, true, Some("redis"));
    assert_all(&s, 2 * (2 * 51 + 3), " SMC-R");
    // the server's own record (its accepts) is there
    assert!(s.modes().iter().filter(|m| m.starts_with("accept")).count() >= 2 * 51 + 3);
}

/// Debian's default: the master as root, the two workers as www-data (the
/// rendezvous opened to users by its install); every connection SMC-R, and
/// the workers' own record of each says so.
#[test]
fn nginx_with_workers_as_www_data_over_smc_r() {
    let s = nginx_as("nginx-www-data", true, true, Some("www-data"));
    assert_all(&s, 2 * 21, " SMC-R");
    let master = std::fs::read_to_string(s.dir.join("nginx.pid")).unwrap_or_default();
    let accepts: Vec<String> = std::fs::read_to_string(s.dir.join("state"))
        .unwrap()
        .lines()
        .filter(|l| l.contains(" accept "))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect();
    assert!(!accepts.is_empty());
    assert!(accepts.iter().all(|p| *p != master.trim()), "{accepts:?}");
}
