//! The egress policy of model and tool calls (SPEC §14): which addresses a worker may
//! connect to on a tenant's behalf.
//!
//! A tenant registers the URL of a model or a tool; a worker then connects to it from inside
//! the deployment's network. Without a policy that is a server-side request forgery
//! primitive: the tenant could point a "model" at the cloud metadata service, at the
//! deployment's Redis or RabbitMQ on loopback, or at anything on the private network, and read
//! the answer back through its runner. The policy is one pure function of an address
//! ([`EgressPolicy::check_ip`]), applied twice:
//!
//! - at **registration**, to the URL's host when it is an IP literal, and to its syntax
//!   ([`EgressPolicy::check_url`]: `http`/`https` only, no credentials in the URL);
//! - at **connect time**, to every address the host name resolves to
//!   ([`EgressPolicy::check_resolved`]), because a name that was public at registration can
//!   resolve to `127.0.0.1` at call time (DNS rebinding). Workers plug this into their HTTP
//!   client's resolver and refuse to follow redirects, so the checked address is the one
//!   connected to.
//!
//! # Rules
//!
//! - Link-local (`169.254.0.0/16`, `fe80::/10`) and the known metadata addresses
//!   ([`METADATA_ADDRESSES`]) are denied in every mode; no allow entry lifts that.
//! - Loopback, unspecified (`0.0.0.0`, `::`), private (`10/8`, `172.16/12`, `192.168/16`,
//!   `fc00::/7`), shared (`100.64/10`), benchmarking, multicast, broadcast, documentation and
//!   reserved ranges are denied unless an allow entry covers them: a CIDR containing the
//!   address, or a host name equal to the URL's host.
//! - IPv4-mapped and IPv4-compatible IPv6 addresses (`::ffff:127.0.0.1`) are judged as the
//!   IPv4 address they carry, and NAT64 (`64:ff9b::/96`) is judged as the embedded address.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde::Deserialize;
use url::{Host, Url};

/// The `[egress]` section of the configuration (re-exported as
/// `sb_common::config::EgressConfig`): where models and tools may be reached (SPEC §14).
/// Outbound calls go only to public addresses unless an entry here allows more: link-local
/// and cloud metadata addresses are denied whatever this says; loopback, private, shared and
/// unspecified ranges are denied unless a CIDR here covers the address or a host name here is
/// the URL's host. The check runs at registration and again on every resolved address at
/// connect time.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EgressConfig {
    /// CIDRs (`127.0.0.0/8`, `10.1.0.0/16`, `::1/128`) or host names (`ollama.internal`),
    /// comma-separated in the environment. `switchboard dev` adds loopback.
    #[serde(deserialize_with = "crate::env_list::deserialize")]
    pub allow: Vec<String>,
}

/// Addresses of cloud instance metadata services, denied whatever the policy allows: AWS,
/// GCP, Azure, OpenStack and DigitalOcean (`169.254.169.254`, also in link-local), AWS's IPv6
/// endpoint (`fd00:ec2::254`), Alibaba Cloud (`100.100.100.200`) and Oracle Cloud's second
/// address (`192.0.0.192`).
pub const METADATA_ADDRESSES: [IpAddr; 4] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),
];

/// Host names of metadata services, denied like their addresses (a resolver may map them
/// anywhere).
const METADATA_HOSTS: [&str; 3] = [
    "metadata.google.internal",
    "metadata",
    "instance-data.ec2.internal",
];

/// Why an outbound call is refused. The message is meant for the tenant that registered the
/// URL: it names the rule, never the operator's configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressError {
    /// Not an absolute `http`/`https` URL with a host.
    #[error("{0} must be an absolute http or https URL with a host")]
    NotHttp(&'static str),
    /// A user name or password in the URL: credentials go in a referenced secret, never in
    /// a URL that is stored, listed and logged.
    #[error("{0} must not carry credentials (use a secret reference instead)")]
    Credentials(&'static str),
    /// The address is link-local or a metadata service.
    #[error("{what} points at a link-local or metadata address ({ip}), which is never reachable")]
    Metadata {
        /// Which field.
        what: &'static str,
        /// The refused address.
        ip: IpAddr,
    },
    /// The address is in a range the operator has not allowed.
    #[error(
        "{what} points at a {range} address ({ip}), which this deployment does not allow \
         (egress.allow)"
    )]
    NotAllowed {
        /// Which field.
        what: &'static str,
        /// The refused address.
        ip: IpAddr,
        /// Its range, e.g. `loopback`.
        range: &'static str,
    },
    /// The host is a metadata service name.
    #[error("{0} points at a metadata service, which is never reachable")]
    MetadataHost(&'static str),
    /// The name resolved to no address the policy allows.
    #[error("{0} resolves to no address this deployment allows")]
    NoAllowedAddress(&'static str),
}

/// One `egress.allow` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowEntry {
    /// Addresses in this network are allowed.
    Net(IpNet),
    /// URLs whose host is this name (lowercase) are allowed, whatever it resolves to
    /// (link-local and metadata still denied).
    Host(String),
}

/// An `egress.allow` entry that is neither a CIDR, an address nor a host name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected a CIDR (`10.0.0.0/8`), an address or a host name, got `{0}`")]
pub struct BadAllowEntry(String);

impl AllowEntry {
    /// Parses `10.0.0.0/8`, `::1/128`, `127.0.0.1` (a /32) or `ollama.internal`.
    ///
    /// # Errors
    ///
    /// [`BadAllowEntry`] for anything else.
    pub fn parse(entry: &str) -> Result<Self, BadAllowEntry> {
        let entry = entry.trim();
        if let Ok(net) = entry.parse::<IpNet>() {
            return Ok(Self::Net(net.trunc()));
        }
        if let Ok(ip) = entry.parse::<IpAddr>() {
            return Ok(Self::Net(IpNet::from(ip)));
        }
        let is_host = !entry.is_empty()
            && entry.len() <= 253
            && entry.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            });
        if is_host {
            Ok(Self::Host(entry.to_ascii_lowercase()))
        } else {
            Err(BadAllowEntry(entry.to_owned()))
        }
    }
}

/// The loopback networks, as `switchboard dev` allows them.
pub const LOOPBACK_ALLOW: [&str; 2] = ["127.0.0.0/8", "::1/128"];

/// The deployment's egress policy, built once from [`EgressConfig`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    nets: Vec<IpNet>,
    hosts: Vec<String>,
}

impl EgressPolicy {
    /// The policy of `egress.allow`. Entries were checked by the configuration's
    /// validation; one that does not parse is ignored (it can only make the policy stricter).
    #[must_use]
    pub fn from_config(config: &EgressConfig) -> Self {
        let mut policy = Self::default();
        for entry in &config.allow {
            match AllowEntry::parse(entry) {
                Ok(AllowEntry::Net(net)) => policy.nets.push(net),
                Ok(AllowEntry::Host(host)) => policy.hosts.push(host),
                Err(_) => {}
            }
        }
        policy
    }

    /// The strictest policy: public addresses only.
    #[must_use]
    pub fn public_only() -> Self {
        Self::default()
    }

    /// Whether `egress.allow` names this host (lowercase comparison).
    #[must_use]
    pub fn allows_host(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.hosts.contains(&host)
    }

    /// Checks one address, for a URL whose host is `host_allowed` by name or not.
    ///
    /// # Errors
    ///
    /// [`EgressError::Metadata`] or [`EgressError::NotAllowed`].
    pub fn check_ip(
        &self,
        what: &'static str,
        ip: IpAddr,
        host_allowed: bool,
    ) -> Result<(), EgressError> {
        let ip = canonical(ip);
        if METADATA_ADDRESSES.iter().any(|m| canonical(*m) == ip) || is_link_local(ip) {
            return Err(EgressError::Metadata { what, ip });
        }
        match special_range(ip) {
            None => Ok(()),
            Some(_) if host_allowed || self.nets.iter().any(|n| n.contains(&ip)) => Ok(()),
            Some(range) => Err(EgressError::NotAllowed { what, ip, range }),
        }
    }

    /// Checks a URL as registered: syntax, credentials, a metadata host name, and the
    /// address when the host is an IP literal. A host name is checked again on every
    /// resolution ([`EgressPolicy::check_resolved`]).
    ///
    /// # Errors
    ///
    /// The first rule the URL breaks.
    pub fn check_url(&self, what: &'static str, url: &str) -> Result<Url, EgressError> {
        let parsed = Url::parse(url).map_err(|_| EgressError::NotHttp(what))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(EgressError::NotHttp(what));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(EgressError::Credentials(what));
        }
        match parsed.host() {
            None => Err(EgressError::NotHttp(what)),
            Some(Host::Ipv4(ip)) => self.check_ip(what, IpAddr::V4(ip), false).map(|()| parsed),
            Some(Host::Ipv6(ip)) => self.check_ip(what, IpAddr::V6(ip), false).map(|()| parsed),
            Some(Host::Domain(name)) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                if METADATA_HOSTS.contains(&name.as_str()) {
                    return Err(EgressError::MetadataHost(what));
                }
                // Names that are addresses in disguise (`0x7f.1`, `2130706433`) are parsed
                // by `url` as IPv4 already; what is left is a real name.
                Ok(parsed)
            }
        }
    }

    /// The addresses of `host` (as resolved at connect time) that the policy allows, or an
    /// error naming the first refusal when none is.
    ///
    /// # Errors
    ///
    /// [`EgressError::NoAllowedAddress`] when the name resolved to nothing, else the refusal
    /// of the first address.
    pub fn check_resolved<A: Copy + Into<IpAddr>>(
        &self,
        what: &'static str,
        host: &str,
        addrs: impl IntoIterator<Item = A>,
    ) -> Result<Vec<A>, EgressError> {
        let host_allowed = self.allows_host(host);
        let mut allowed = Vec::new();
        let mut first_refusal = None;
        for addr in addrs {
            match self.check_ip(what, addr.into(), host_allowed) {
                Ok(()) => allowed.push(addr),
                Err(e) => {
                    first_refusal.get_or_insert(e);
                }
            }
        }
        if allowed.is_empty() {
            Err(first_refusal.unwrap_or(EgressError::NoAllowedAddress(what)))
        } else {
            Ok(allowed)
        }
    }
}

impl fmt::Display for EgressPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nets.is_empty() && self.hosts.is_empty() {
            return f.write_str("public addresses only");
        }
        let entries: Vec<String> = self
            .nets
            .iter()
            .map(ToString::to_string)
            .chain(self.hosts.iter().cloned())
            .collect();
        write!(f, "public addresses and {}", entries.join(", "))
    }
}

/// An IPv6 address that carries an IPv4 one (mapped, compatible, NAT64) as that IPv4
/// address; anything else unchanged.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return IpAddr::V4(v4);
            }
            let s = v6.segments();
            // NAT64 well-known prefix 64:ff9b::/96.
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let o = v6.octets();
                return IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
            }
            // IPv4-compatible ::a.b.c.d (deprecated, still routed by some stacks); `::` and
            // `::1` stay IPv6.
            if s[..6] == [0; 6] && (s[6] != 0 || s[7] > 1) {
                let o = v6.octets();
                return IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
            }
            IpAddr::V6(v6)
        }
        v4 => v4,
    }
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// The name of the non-public range `ip` is in, if any.
fn special_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            if v4.is_loopback() {
                Some("loopback")
            } else if v4.is_unspecified() || o[0] == 0 {
                Some("unspecified")
            } else if v4.is_private() {
                Some("private")
            } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
                Some("shared (carrier-grade NAT)")
            } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
                Some("benchmarking")
            } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
                Some("IETF protocol assignment")
            } else if v4.is_documentation() {
                Some("documentation")
            } else if v4.is_multicast() {
                Some("multicast")
            } else if v4.is_broadcast() || o[0] >= 240 {
                Some("reserved")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if (s[0] & 0xfe00) == 0xfc00 {
                Some("private (unique local)")
            } else if (s[0] & 0xffc0) == 0xfec0 {
                Some("site-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if s[0] == 0x2001 && s[1] == 0x0db8 {
                Some("documentation")
            } else if s[0] == 0x0100 && s[1..4] == [0, 0, 0] {
                Some("discard")
            } else if s[0] == 0x2002 {
                // 6to4 embeds an IPv4 address that may be private; public 6to4 relays are
                // all but gone, so the range is refused instead of decoded.
                Some("6to4")
            } else {
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str]) -> EgressPolicy {
        EgressPolicy::from_config(&EgressConfig {
            allow: allow.iter().map(|s| (*s).to_owned()).collect(),
        })
    }

    #[test]
    fn public_addresses_pass_and_every_special_range_is_refused() {
        let p = EgressPolicy::public_only();
        for ok in [
            "https://api.openai.com/v1",
            "http://8.8.8.8/",
            "https://[2606:4700::1111]/",
        ] {
            assert!(p.check_url("base_url", ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://127.0.0.1:6379/",
            "http://127.1/",
            "http://2130706433/",
            "http://0x7f000001/",
            "http://0.0.0.0:5432/",
            "http://[::]/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:7f00:1]/",
            "http://[64:ff9b::7f00:1]/",
            "http://10.0.0.5/",
            "http://172.16.1.1/",
            "http://192.168.1.1/",
            "http://100.64.0.1/",
            "http://[fd12::1]/",
            "http://224.0.0.1/",
            "http://255.255.255.255/",
        ] {
            assert!(
                matches!(p.check_url("url", bad), Err(EgressError::NotAllowed { .. })),
                "{bad}: {:?}",
                p.check_url("url", bad)
            );
        }
    }

    #[test]
    fn metadata_and_link_local_are_refused_even_when_allowed() {
        let p = policy(&["0.0.0.0/0", "::/0", "metadata.google.internal"]);
        for bad in [
            "http://169.254.169.254/latest/meta-data/",
            "http://169.254.1.1/",
            "http://[fe80::1]/",
            "http://[fd00:ec2::254]/",
            "http://[::ffff:169.254.169.254]/",
            "http://100.100.100.200/",
        ] {
            assert!(
                matches!(p.check_url("url", bad), Err(EgressError::Metadata { .. })),
                "{bad}: {:?}",
                p.check_url("url", bad)
            );
        }
        assert_eq!(
            p.check_url("url", "http://metadata.google.internal/x"),
            Err(EgressError::MetadataHost("url"))
        );
    }

    #[test]
    fn credentials_and_other_schemes_are_refused() {
        let p = EgressPolicy::public_only();
        assert_eq!(
            p.check_url("url", "https://user:pw@api.example.com/"),
            Err(EgressError::Credentials("url"))
        );
        assert_eq!(
            p.check_url("url", "https://user@api.example.com/"),
            Err(EgressError::Credentials("url"))
        );
        for bad in [
            "file:///etc/passwd",
            "ftp://x/",
            "gopher://127.0.0.1/",
            "http://",
            "nope",
        ] {
            assert_eq!(
                p.check_url("url", bad),
                Err(EgressError::NotHttp("url")),
                "{bad}"
            );
        }
    }

    #[test]
    fn allow_entries_open_exactly_what_they_name() {
        let p = policy(&["127.0.0.0/8", "10.1.0.0/16", "ollama.internal"]);
        assert!(p.check_url("url", "http://127.0.0.1:11434/v1").is_ok());
        assert!(p.check_url("url", "http://10.1.2.3/").is_ok());
        assert!(p.check_url("url", "http://10.2.0.1/").is_err());
        assert!(
            p.check_url("url", "http://[::1]/").is_err(),
            "v6 loopback not listed"
        );
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let private: IpAddr = "192.168.5.5".parse().unwrap();
        assert_eq!(
            p.check_resolved("url", "Ollama.Internal.", [private])
                .unwrap(),
            vec![private]
        );
        assert!(p.check_resolved("url", "evil.example", [private]).is_err());
        // A rebinding name: only the allowed addresses are kept.
        let public: IpAddr = "93.184.216.34".parse().unwrap();
        let strict = EgressPolicy::public_only();
        assert_eq!(
            strict
                .check_resolved("url", "rebind.example", [lo, public])
                .unwrap(),
            vec![public]
        );
        assert!(matches!(
            strict.check_resolved("url", "rebind.example", [lo]),
            Err(EgressError::NotAllowed { .. })
        ));
        assert_eq!(
            strict.check_resolved::<IpAddr>("url", "nothing.example", []),
            Err(EgressError::NoAllowedAddress("url"))
        );
    }

    #[test]
    fn allow_entries_parse() {
        assert_eq!(
            AllowEntry::parse("127.0.0.1").unwrap(),
            AllowEntry::Net("127.0.0.1/32".parse().unwrap())
        );
        assert_eq!(
            AllowEntry::parse("10.1.2.3/16").unwrap(),
            AllowEntry::Net("10.1.0.0/16".parse().unwrap())
        );
        assert_eq!(
            AllowEntry::parse("Ollama.LAN").unwrap(),
            AllowEntry::Host("ollama.lan".into())
        );
        for bad in ["", "10.0.0.0/33", "http://x", "a b", "x..y"] {
            assert!(AllowEntry::parse(bad).is_err(), "{bad}");
        }
    }
}
