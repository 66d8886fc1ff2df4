//! The store conformance suite on SQLite: a WAL database file per test, and in-memory.

mod file {
    sb_store::store_suite!(sb_store::testing::sqlite_file_db());
}

mod memory {
    sb_store::store_suite!(sb_store::testing::sqlite_memory_db());
}
