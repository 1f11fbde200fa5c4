//! Zero-configuration discovery over mDNS (mdns-sd): every daemon advertises
//! `<peer id>._gleam._udp.local.` and browses for the others.
//!
//! mDNS is only a hint: anyone on the LAN can advertise anything, so an advertised id is trusted
//! only after the TLS handshake proves it (see [`gleam_auth::tls`]) and the mesh secret is proved (see
//! [`gleam_auth::proof`]).

use std::net::{IpAddr, SocketAddr, SocketAddrV6};

use mdns_sd::{IfKind, ResolvedService, ScopedIp, ServiceDaemon, ServiceEvent, ServiceInfo};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::state::{GpuSummary, PROTOCOL_VERSION};
use gleam_auth::identity::PeerId;

/// The DNS-SD service type of Gleam peers.
pub const SERVICE_TYPE: &str = "_gleam._udp.local.";

/// What this daemon advertises (static facts only; load travels by gossip).
#[derive(Clone, Debug)]
pub struct Advertisement {
    /// Our id (also the instance name).
    pub id: PeerId,
    /// Our QUIC port.
    pub port: u16,
    /// Our GPUs, summarized in the TXT record.
    pub gpus: Vec<GpuSummary>,
}

/// A change seen on the LAN.
#[derive(Clone, Debug, PartialEq)]
pub enum DiscoveryEvent {
    /// A peer advertises itself (again) at these addresses.
    Found {
        /// The advertised id (unverified until a handshake proves it).
        id: PeerId,
        /// Where to reach it, IPv4 first.
        addrs: Vec<SocketAddr>,
        /// Its protocol version.
        protocol: u32,
    },
    /// A peer withdrew its advertisement (or its record expired).
    Lost {
        /// The id it advertised.
        id: PeerId,
    },
}

/// A running mDNS responder and browser. Dropping it without [`Discovery::shutdown`] leaves the
/// record to expire; shutting down sends goodbye packets.
pub struct Discovery {
    daemon: ServiceDaemon,
    fullname: String,
}

impl Discovery {
    /// Registers `ad` and starts browsing; events arrive on `events`. `interfaces` restricts
    /// mDNS to those interface names (empty: every interface that is up, loopback included).
    pub fn start(
        ad: &Advertisement,
        interfaces: &[String],
        events: mpsc::UnboundedSender<DiscoveryEvent>,
    ) -> Result<Self, DiscoveryError> {
        let daemon = ServiceDaemon::new()?;
        if !interfaces.is_empty() {
            daemon.disable_interface(IfKind::All)?;
            for name in interfaces {
                daemon.enable_interface(IfKind::Name(name.clone()))?;
            }
        }
        // Pick up interfaces and addresses that appear later (e.g. IPv6 after DAD) quickly.
        daemon.set_ip_check_interval(IP_CHECK_SECS)?;

        let instance = ad.id.to_string();
        let host = format!("{instance}.local.");
        let properties = txt_properties(ad);
        let info = ServiceInfo::new(SERVICE_TYPE, &instance, &host, (), ad.port, &properties[..])?
            .enable_addr_auto();
        let fullname = info.get_fullname().to_owned();
        daemon.register(info)?;
        let receiver = daemon.browse(SERVICE_TYPE)?;
        info!(id = %ad.id, port = ad.port, "advertising on mDNS");

        let browser = daemon.clone();
        tokio::spawn(async move {
            let mut receiver = receiver;
            loop {
                match receiver.recv_async().await {
                    Ok(event) => {
                        if let Some(event) = translate(event)
                            && events.send(event).is_err()
                        {
                            return;
                        }
                    }
                    Err(_) => {
                        // The daemon closes a browse channel that fell behind; browse again
                        // unless we are shutting down (the send side is gone for good then).
                        if events.is_closed() {
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                        match browser.browse(SERVICE_TYPE) {
                            Ok(fresh) => receiver = fresh,
                            Err(err) => {
                                debug!(error = %gleam_auth::Chain(&err), "mDNS browsing stopped");
                                return;
                            }
                        }
                    }
                }
            }
        });
        Ok(Self { daemon, fullname })
    }

    /// Withdraws our advertisement (goodbye packets) and stops the mDNS daemon.
    pub fn shutdown(self) {
        if let Ok(status) = self.daemon.unregister(&self.fullname) {
            let _ = status.recv_timeout(std::time::Duration::from_millis(500));
        }
        let _ = self.daemon.stop_browse(SERVICE_TYPE);
        let _ = self.daemon.shutdown();
    }
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery")
            .field("fullname", &self.fullname)
            .finish_non_exhaustive()
    }
}

/// mDNS could not be started.
#[derive(Debug, thiserror::Error)]
#[error("mDNS could not start")]
pub struct DiscoveryError(#[from] mdns_sd::Error);

fn txt_properties(ad: &Advertisement) -> Vec<(&'static str, String)> {
    let mut properties = vec![
        ("id", ad.id.to_string()),
        ("v", PROTOCOL_VERSION.to_string()),
    ];
    if let Some(first) = ad.gpus.first() {
        let memory_gib: u64 = ad.gpus.iter().map(|gpu| gpu.total_memory >> 30).sum();
        let (major, minor) = first.compute_capability;
        let mut model = first.model.clone();
        model.truncate(64);
        properties.push(("gpu", format!("{model}x{}", ad.gpus.len())));
        properties.push(("mem", memory_gib.to_string()));
        properties.push(("cc", format!("{major}.{minor}")));
        properties.push(("emu", u8::from(first.emulated).to_string()));
    }
    properties
}

fn translate(event: ServiceEvent) -> Option<DiscoveryEvent> {
    match event {
        ServiceEvent::ServiceResolved(service) => resolved(&service),
        ServiceEvent::ServiceRemoved(_, fullname) => {
            let instance = fullname.strip_suffix(SERVICE_TYPE)?.strip_suffix('.')?;
            Some(DiscoveryEvent::Lost {
                id: instance.parse().ok()?,
            })
        }
        _ => None,
    }
}

fn resolved(service: &ResolvedService) -> Option<DiscoveryEvent> {
    let id: PeerId = match service.get_property_val_str("id").map(str::parse) {
        Some(Ok(id)) => id,
        _ => {
            warn!(name = %service.fullname, "ignoring a Gleam advertisement without a valid id");
            return None;
        }
    };
    let protocol = service
        .get_property_val_str("v")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut addrs: Vec<SocketAddr> = service
        .addresses
        .iter()
        .filter_map(|ip| socket_addr(ip, service.port))
        .collect();
    // Loopback only helps peers on the same host; drop it when there is anything else.
    if addrs.iter().any(|addr| !addr.ip().is_loopback()) {
        addrs.retain(|addr| !addr.ip().is_loopback());
    }
    // IPv4 first (no scope ids to get wrong), then IPv6; deterministic order within each.
    addrs.sort_by_key(|addr| (addr.is_ipv6(), *addr));
    debug!(%id, ?addrs, "mDNS resolved a peer");
    Some(DiscoveryEvent::Found {
        id,
        addrs,
        protocol,
    })
}

fn socket_addr(ip: &ScopedIp, port: u16) -> Option<SocketAddr> {
    match ip.to_ip_addr() {
        IpAddr::V4(v4) => Some(SocketAddr::from((v4, port))),
        IpAddr::V6(v6) => {
            // Link-local addresses need the interface they were seen on.
            let scope = match (v6.segments()[0] & 0xffc0 == 0xfe80, ip) {
                (true, ScopedIp::V6(scoped)) => scoped.scope_id().index,
                (true, _) => return None,
                (false, _) => 0,
            };
            Some(SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope)))
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

const IP_CHECK_SECS: u32 = 2;
