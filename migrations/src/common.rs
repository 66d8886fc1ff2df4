//! Column helpers shared by the migration files, and the backend-specific DDL.
//!
//! Applied migrations must keep producing the same DDL: change a helper only in a way that
//! leaves the statements it emits for existing migrations untouched.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DbBackend;

/// Length of id-like text columns (workspace, conversation, bot, runner ids, …).
pub const ID_LEN: u32 = 255;

/// A non-null `varchar(255)`.
pub fn id<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).string_len(ID_LEN).not_null().take()
}

/// A nullable `varchar(255)`.
pub fn id_null<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).string_len(ID_LEN).null().take()
}

/// A non-null `varchar(len)`.
pub fn str_len<T: IntoIden>(col: T, len: u32) -> ColumnDef {
    ColumnDef::new(col).string_len(len).not_null().take()
}

/// A nullable `varchar(len)`.
pub fn str_len_null<T: IntoIden>(col: T, len: u32) -> ColumnDef {
    ColumnDef::new(col).string_len(len).null().take()
}

/// A non-null timestamp with time zone.
pub fn ts<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col)
        .timestamp_with_time_zone()
        .not_null()
        .take()
}

/// A nullable timestamp with time zone.
pub fn ts_null<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).timestamp_with_time_zone().null().take()
}

/// A non-null JSON document (`jsonb` on Postgres).
pub fn json<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).json_binary().not_null().take()
}

/// A nullable JSON document (`jsonb` on Postgres).
pub fn json_null<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).json_binary().null().take()
}

/// A non-null UUID.
pub fn uuid<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).uuid().not_null().take()
}

/// A nullable UUID.
pub fn uuid_null<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).uuid().null().take()
}

/// A non-null `bigint`.
pub fn bigint<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).big_integer().not_null().take()
}

/// A nullable `bigint`.
pub fn bigint_null<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).big_integer().null().take()
}

/// An auto-increment `bigint` primary key: identity on Postgres, a rowid alias with
/// `AUTOINCREMENT` on SQLite (so values are never reused after deletes, which matters for
/// cursors).
pub fn seq_pk<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col)
        .big_integer()
        .not_null()
        .auto_increment()
        .primary_key()
        .take()
}

/// A non-null key column whose ordering and prefix matching must be bytewise on both
/// backends (SQLite's default `BINARY` collation; `"C"` on Postgres).
pub fn ordered_key<T: IntoIden>(col: T, len: u32, backend: DbBackend) -> ColumnDef {
    let mut def = ColumnDef::new(col).string_len(len).not_null().take();
    if backend == DbBackend::Postgres {
        def.extra("COLLATE \"C\"");
    }
    def
}

/// Runs `sql` on Postgres only: a change SQLite does not need (or cannot make without
/// rebuilding a table), each such migration saying why.
pub async fn on_postgres(manager: &SchemaManager<'_>, sql: &str) -> Result<(), DbErr> {
    if manager.get_database_backend() == DbBackend::Postgres {
        manager.get_connection().execute_unprepared(sql).await?;
    }
    Ok(())
}

/// How a full-text index turns text into terms. Each variant is implemented the same way in
/// meaning on both backends (the query side must tokenise the same way: see the store).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextSearch {
    /// Lower-cased whole words, no stemming, no stop words: Postgres `simple`, SQLite FTS5
    /// `unicode61 remove_diacritics 0`. Transcript search uses it (exact-word queries).
    Simple,
    /// English stemming (`refunds` and `refund`, `configured` and `configure` index as one
    /// term): Postgres `english` (Snowball stemmer, English stop words dropped), SQLite FTS5
    /// `porter unicode61 remove_diacritics 0` (Porter stemmer over the same word splitting;
    /// stop words are dropped by the store's query builder instead). Knowledge bases use it.
    English,
}

impl TextSearch {
    /// The Postgres text search configuration.
    fn postgres_config(self) -> &'static str {
        match self {
            Self::Simple => "simple",
            Self::English => "english",
        }
    }

    /// The SQLite FTS5 `tokenize` option.
    fn fts5_tokenizer(self) -> &'static str {
        match self {
            Self::Simple => "unicode61 remove_diacritics 0",
            Self::English => "porter unicode61 remove_diacritics 0",
        }
    }
}

/// Makes `table.text_col` full-text searchable with [`TextSearch::Simple`].
///
/// - Postgres: a stored generated column `<text_col>_tsv = to_tsvector('simple', …)` and a
///   GIN index on it. `simple` = lower-casing, no stemming, no stop words.
/// - SQLite: an external-content FTS5 table `<table>_fts` over `text_col`, keyed by the
///   table's integer primary key `rowid_col`, plus insert/update/delete triggers. The
///   `unicode61` tokenizer with `remove_diacritics 0` matches Postgres' `simple` behaviour.
///
/// Applied migrations call this; its behaviour must never change (use
/// [`create_full_text_as`] or [`rebuild_full_text`] for anything else).
pub async fn create_full_text(
    manager: &SchemaManager<'_>,
    table: &str,
    text_col: &str,
    rowid_col: &str,
) -> Result<(), DbErr> {
    create_full_text_as(manager, table, text_col, rowid_col, TextSearch::Simple).await
}

/// Makes `table.text_col` full-text searchable with `search` (see [`create_full_text`] for
/// the structures). Rows already in the table are indexed on Postgres (the generated column
/// is computed for them); on SQLite the FTS5 table starts empty, see [`rebuild_full_text`].
pub async fn create_full_text_as(
    manager: &SchemaManager<'_>,
    table: &str,
    text_col: &str,
    rowid_col: &str,
    search: TextSearch,
) -> Result<(), DbErr> {
    let db = manager.get_connection();
    match manager.get_database_backend() {
        DbBackend::Postgres => {
            let config = search.postgres_config();
            db.execute_unprepared(&format!(
                "ALTER TABLE \"{table}\" ADD COLUMN \"{text_col}_tsv\" tsvector \
                 GENERATED ALWAYS AS (to_tsvector('{config}'::regconfig, coalesce(\"{text_col}\", ''))) STORED"
            ))
            .await?;
            db.execute_unprepared(&format!(
                "CREATE INDEX \"ix_{table}_{text_col}_tsv\" ON \"{table}\" USING GIN (\"{text_col}_tsv\")"
            ))
            .await?;
        }
        DbBackend::Sqlite => {
            let tokenizer = search.fts5_tokenizer();
            db.execute_unprepared(&format!(
                "CREATE VIRTUAL TABLE \"{table}_fts\" USING fts5(\"{text_col}\", \
                 content='{table}', content_rowid='{rowid_col}', \
                 tokenize='{tokenizer}')"
            ))
            .await?;
            db.execute_unprepared(&format!(
                "CREATE TRIGGER \"{table}_fts_ai\" AFTER INSERT ON \"{table}\" BEGIN \
                 INSERT INTO \"{table}_fts\"(rowid, \"{text_col}\") VALUES (new.\"{rowid_col}\", new.\"{text_col}\"); \
                 END"
            ))
            .await?;
            db.execute_unprepared(&format!(
                "CREATE TRIGGER \"{table}_fts_ad\" AFTER DELETE ON \"{table}\" BEGIN \
                 INSERT INTO \"{table}_fts\"(\"{table}_fts\", rowid, \"{text_col}\") VALUES ('delete', old.\"{rowid_col}\", old.\"{text_col}\"); \
                 END"
            ))
            .await?;
            db.execute_unprepared(&format!(
                "CREATE TRIGGER \"{table}_fts_au\" AFTER UPDATE OF \"{text_col}\" ON \"{table}\" BEGIN \
                 INSERT INTO \"{table}_fts\"(\"{table}_fts\", rowid, \"{text_col}\") VALUES ('delete', old.\"{rowid_col}\", old.\"{text_col}\"); \
                 INSERT INTO \"{table}_fts\"(rowid, \"{text_col}\") VALUES (new.\"{rowid_col}\", new.\"{text_col}\"); \
                 END"
            ))
            .await?;
        }
        other => {
            return Err(DbErr::Migration(format!(
                "full-text search is not supported on {other:?}"
            )));
        }
    }
    Ok(())
}

/// Replaces the full-text structures of `table.text_col` by ones built with `search`, and
/// indexes every row already in the table with them, in the migration's transaction.
///
/// - Postgres: the generated column (and its index, which depends on it) is dropped and
///   added again with the new configuration; adding a stored generated column computes it
///   for every existing row.
/// - SQLite: the FTS5 table and its triggers are dropped and created again, then the FTS5
///   `rebuild` command re-reads every row from the content table.
pub async fn rebuild_full_text(
    manager: &SchemaManager<'_>,
    table: &str,
    text_col: &str,
    rowid_col: &str,
    search: TextSearch,
) -> Result<(), DbErr> {
    let db = manager.get_connection();
    let backend = manager.get_database_backend();
    if backend == DbBackend::Postgres {
        db.execute_unprepared(&format!(
            "ALTER TABLE \"{table}\" DROP COLUMN IF EXISTS \"{text_col}_tsv\""
        ))
        .await?;
    } else {
        drop_full_text(manager, table).await?;
    }
    create_full_text_as(manager, table, text_col, rowid_col, search).await?;
    if backend == DbBackend::Sqlite {
        db.execute_unprepared(&format!(
            "INSERT INTO \"{table}_fts\"(\"{table}_fts\") VALUES ('rebuild')"
        ))
        .await?;
    }
    Ok(())
}

/// Reverts [`create_full_text`] (the Postgres column goes away with its table).
pub async fn drop_full_text(manager: &SchemaManager<'_>, table: &str) -> Result<(), DbErr> {
    if manager.get_database_backend() == DbBackend::Sqlite {
        let db = manager.get_connection();
        for suffix in ["ai", "ad", "au"] {
            db.execute_unprepared(&format!("DROP TRIGGER IF EXISTS \"{table}_fts_{suffix}\""))
                .await?;
        }
        db.execute_unprepared(&format!("DROP TABLE IF EXISTS \"{table}_fts\""))
            .await?;
    }
    Ok(())
}

/// `CREATE INDEX name ON table (cols…)`.
pub fn index<T, C>(name: &str, table: T, cols: C) -> IndexCreateStatement
where
    T: IntoTableRef,
    C: IntoIterator,
    C::Item: IntoIndexColumn,
{
    let mut stmt = Index::create();
    stmt.name(name).table(table);
    for col in cols {
        stmt.col(col);
    }
    stmt
}

/// `CREATE UNIQUE INDEX name ON table (cols…)`.
pub fn unique_index<T, C>(name: &str, table: T, cols: C) -> IndexCreateStatement
where
    T: IntoTableRef,
    C: IntoIterator,
    C::Item: IntoIndexColumn,
{
    let mut stmt = index(name, table, cols);
    stmt.unique();
    stmt
}

/// A non-null unbounded text column.
pub fn text<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).text().not_null().take()
}

/// A nullable unbounded text column.
pub fn text_null<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).text().null().take()
}

/// A non-null boolean.
pub fn boolean<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).boolean().not_null().take()
}

/// A non-null binary payload (`bytea` / `blob`).
pub fn bytes<T: IntoIden>(col: T) -> ColumnDef {
    ColumnDef::new(col).blob().not_null().take()
}

/// Lets a table's hot updates stay heap-only (no index entry written): drops `index`, the
/// one indexed column those updates change, and on Postgres leaves 30 % of every new page
/// free (`fillfactor = 70`) so the new row version finds room beside the old one. SQLite
/// has no fill factor.
pub async fn allow_heap_only_updates(
    manager: &SchemaManager<'_>,
    table: &str,
    index: &str,
) -> Result<(), DbErr> {
    let db = manager.get_connection();
    db.execute_unprepared(&format!("DROP INDEX IF EXISTS {index}"))
        .await?;
    if manager.get_database_backend() == DbBackend::Postgres {
        db.execute_unprepared(&format!("ALTER TABLE {table} SET (fillfactor = 70)"))
            .await?;
    }
    Ok(())
}

/// Undoes [`allow_heap_only_updates`]: the default fill factor, and `index` on `columns`.
pub async fn forbid_heap_only_updates(
    manager: &SchemaManager<'_>,
    table: &str,
    index: &str,
    columns: &str,
) -> Result<(), DbErr> {
    let db = manager.get_connection();
    if manager.get_database_backend() == DbBackend::Postgres {
        db.execute_unprepared(&format!("ALTER TABLE {table} RESET (fillfactor)"))
            .await?;
    }
    db.execute_unprepared(&format!("CREATE INDEX {index} ON {table} ({columns})"))
        .await?;
    Ok(())
}
