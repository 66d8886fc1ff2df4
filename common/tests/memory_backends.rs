//! The bus, dead-letter and session-store conformance suites on the in-memory backends (always
//! run).

use sb_common::testing::{BusFixture, DeadLettersFixture, SessionFixture};

sb_common::bus_suite!(memory_bus, || async { BusFixture::memory() });
sb_common::dead_letters_suite!(memory_dead_letters, || async {
    DeadLettersFixture::memory()
});
sb_common::session_suite!(memory_session, || async { SessionFixture::memory() });
