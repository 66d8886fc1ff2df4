//! The gateway client of the `switchboard` library ([`switchboard::client`]) and the
//! commands built on it (`send`, `bench`, `keys --url`, the resource commands), in process:
//!
//! - against the stand-in gateway of [`sb_tests::stand_in_gateway`], which injects the faults
//!   the client must survive ([`follow`], [`send`], [`bench`]);
//! - against the real host on the in-memory harness ([`real_gateway`]): the real SSE framing,
//!   the `x-event-id` header, the real error frames and the ledger-then-live stream.

mod bench;
mod follow;
mod real_gateway;
mod send;
