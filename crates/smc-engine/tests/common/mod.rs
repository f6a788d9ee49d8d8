//! What the endpoint tests over the sim fabric share: endpoint
//! configurations, and a world of two endpoints whose CLC bytes travel over
//! an in-memory pipe standing in for the TCP connection.
#![allow(dead_code)]

use smc_engine::endpoint::{ConnId, ConnStatus, Endpoint, EndpointConfig};
use smc_proto::negotiate::IfAddr;
use smc_proto::Timestamp;
use smc_rdma::sim::SimFabric;
use smc_wire::types::{Eid, Mac, SystemId};
use std::net::IpAddr;
use std::time::Duration;

pub fn config(
    dev: &str,
    inst: u16,
    last: u8,
    ueids: &[&str],
    v1: bool,
    v2: bool,
    net: [u8; 3],
) -> EndpointConfig {
    EndpointConfig {
        system_id: SystemId::new(inst, Mac([2, 0, 0, 0, 0, last])),
        device: dev.into(),
        ueids: ueids.iter().map(|u| Eid::parse_ueid(u).unwrap()).collect(),
        offer_v1: v1,
        offer_v2: v2,
        if_addrs: vec![IfAddr {
            addr: IpAddr::from([net[0], net[1], net[2], last]),
            prefix_len: 24,
        }],
        rmb_len: 16384,
        rmb_crowding: None,
        sndbuf_len: 32768,
        testlink: None,
        max_conns: 255,
        hostname: "simhost".into(),
        lgr_idle_timeout: Duration::from_secs(600),
    }
}

/// `config` with the usual test identity: UEID SMC-TEST-UEID, v1 and v2,
/// address 10.99.0.`last`/24.
pub fn simple_config(dev: &str, inst: u16, last: u8) -> EndpointConfig {
    config(dev, inst, last, &["SMC-TEST-UEID"], true, true, [10, 99, 0])
}

/// Adds the RoCE device an endpoint configuration names to the fabric: a
/// port whose GID table carries the configuration's addresses, with RoCE v1
/// and v2 entries (an RNIC's table; the GIDs a connection uses follow from
/// its local address).
pub fn add_device_for(fabric: &SimFabric, cfg: &EndpointConfig) {
    add_port_for(fabric, cfg, true);
}

/// [`add_device_for`], with RoCE v1 entries or (`roce_v1` false) only RoCE
/// v2 ones, as rxe.
pub fn add_port_for(fabric: &SimFabric, cfg: &EndpointConfig, roce_v1: bool) {
    let addrs: Vec<IpAddr> = cfg.if_addrs.iter().map(|a| a.addr).collect();
    fabric
        .add_device_with_addrs(&cfg.device, None, &addrs, roce_v1)
        .unwrap();
}

pub struct World {
    pub fabric: SimFabric,
    pub client: Endpoint<SimFabric>,
    pub server: Endpoint<SimFabric>,
    pub now: Timestamp,
    pub client_ip: IpAddr,
    pub server_ip: IpAddr,
}

/// One TCP connection: the CLC bytes in flight each way.
pub struct Tcp {
    pub c: ConnId,
    pub s: ConnId,
    pub c2s: Vec<u8>,
    pub s2c: Vec<u8>,
}

impl World {
    pub fn new(client_cfg: EndpointConfig, server_cfg: EndpointConfig) -> World {
        World::with_seed(99, client_cfg, server_cfg)
    }

    pub fn with_seed(seed: u64, client_cfg: EndpointConfig, server_cfg: EndpointConfig) -> World {
        World::with_ports(seed, client_cfg, server_cfg, true)
    }

    /// Two endpoints whose ports have RoCE v1 entries or (`roce_v1` false)
    /// only RoCE v2 ones, as rxe.
    pub fn with_ports(
        seed: u64,
        client_cfg: EndpointConfig,
        server_cfg: EndpointConfig,
        roce_v1: bool,
    ) -> World {
        World::with_fabric(SimFabric::new(seed), client_cfg, server_cfg, roce_v1)
    }

    /// As [`World::with_ports`] on a fabric set up beforehand (its devices'
    /// limits: see `SimFabric`'s setters).
    pub fn with_fabric(
        fabric: SimFabric,
        client_cfg: EndpointConfig,
        server_cfg: EndpointConfig,
        roce_v1: bool,
    ) -> World {
        add_port_for(&fabric, &client_cfg, roce_v1);
        add_port_for(&fabric, &server_cfg, roce_v1);
        let client_ip = client_cfg.if_addrs[0].addr;
        let server_ip = server_cfg.if_addrs[0].addr;
        World {
            client: Endpoint::new(&fabric, client_cfg).unwrap(),
            server: Endpoint::new(&fabric, server_cfg).unwrap(),
            fabric,
            now: Duration::ZERO,
            client_ip,
            server_ip,
        }
    }

    pub fn default() -> World {
        World::new(
            config(
                "simC",
                0x1111,
                1,
                &["SMC-TEST-UEID"],
                true,
                true,
                [10, 99, 0],
            ),
            config(
                "simS",
                0x2222,
                2,
                &["SMC-TEST-UEID"],
                true,
                true,
                [10, 99, 0],
            ),
        )
    }

    pub fn open(&mut self) -> Tcp {
        self.open_between(self.client_ip, self.server_ip)
    }

    /// A TCP connection from `client_ip` to `server_ip`.
    pub fn open_between(&mut self, client_ip: IpAddr, server_ip: IpAddr) -> Tcp {
        let s = self.server.accept(server_ip, self.now);
        let c = self.client.connect(client_ip, self.now);
        Tcp {
            c,
            s,
            c2s: Vec::new(),
            s2c: Vec::new(),
        }
    }

    pub fn step(&mut self, tcps: &mut [&mut Tcp]) {
        for t in tcps.iter_mut() {
            t.c2s.extend(self.client.clc_output(t.c));
            t.s2c.extend(self.server.clc_output(t.s));
            let n = self.server.clc_input(t.s, &t.c2s, self.now);
            t.c2s.drain(..n);
            let n = self.client.clc_input(t.c, &t.s2c, self.now);
            t.s2c.drain(..n);
        }
        self.tick();
    }

    /// Both endpoints pump, then 20 us pass (a step without CLC traffic).
    pub fn tick(&mut self) {
        self.client.pump(self.now).unwrap();
        self.server.pump(self.now).unwrap();
        self.fabric.advance(Duration::from_micros(20));
        self.now += Duration::from_micros(20);
    }

    pub fn settle(&mut self, tcps: &mut [&mut Tcp], d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.step(tcps);
        }
    }

    /// [`Self::settle`] for `d`, the client asking after each step for the
    /// completions of connections `conns`' CDCs (`Endpoint::send_queue`:
    /// unsignaled ones that nothing followed get a probe), so that every
    /// CDC of theirs posted before has completed.
    pub fn idle(&mut self, conns: &[ConnId], d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.step(&mut []);
            for &c in conns {
                self.client.send_queue(c);
            }
        }
    }

    /// Runs `t`'s handshake until the client counts itself established
    /// (a reused group's client, once its CLC Confirm went out); the server
    /// gets nothing of the client's from then on. Returns those bytes (the
    /// Confirm): on "TCP" still.
    pub fn hold_confirm(&mut self, t: &mut Tcp) -> Vec<u8> {
        let mut held = Vec::new();
        for _ in 0..500 {
            held.extend(self.client.clc_output(t.c));
            t.s2c.extend(self.server.clc_output(t.s));
            if self.client.status(t.c) != Some(ConnStatus::Smc) {
                t.c2s.append(&mut held);
                let n = self.server.clc_input(t.s, &t.c2s, self.now);
                t.c2s.drain(..n);
            }
            let n = self.client.clc_input(t.c, &t.s2c, self.now);
            t.s2c.drain(..n);
            self.tick();
            if self.client.status(t.c) == Some(ConnStatus::Smc) {
                break;
            }
        }
        assert_eq!(self.client.status(t.c), Some(ConnStatus::Smc));
        held.extend(self.client.clc_output(t.c));
        assert!(!held.is_empty(), "the Confirm is held back");
        held
    }

    pub fn handshake(&mut self) -> Tcp {
        let mut t = self.open();
        self.settle(&mut [&mut t], Duration::from_millis(2));
        t
    }
}
