//! Several statements sent to a SQLite connection as one.
//!
//! Every statement on a SQLite connection is a hand-over to the connection's own thread and
//! back: the caller's task sends it, the thread runs it, the task is woken with the answer and
//! sends the next. On the one writer (see "One SQLite writer" in the module docs of
//! [`super`]) that round trip, not the statement, is most of what a write costs: the
//! connection sits idle until the runtime gets round to the task again, and every write of
//! the host queues behind it. A transaction that ran one statement per row (a batch of run
//! starts updating each one's event, a sink batch ending each finished run) paid it per row.
//!
//! A [`Script`] joins statements built by sea-query into one text with one parameter list:
//! sqlx's SQLite driver runs every statement of a text in order and binds the anonymous `?`
//! parameters across them in order, so the whole list costs one hand-over. It is a list of
//! statements, not a transaction: the caller runs it inside its write transaction, which a
//! failing statement rolls back whole. Postgres takes one statement per extended query, so
//! there the statements run one after the other (its hot batches are single statements over
//! `jsonb` rows instead).

use sea_orm::{ConnectionTrait, DbBackend, QueryResult, QueryTrait, Statement, StatementBuilder};

use crate::error::Result;

/// Statements collected to run in one hand-over on SQLite (see the module docs).
#[derive(Debug)]
pub(crate) struct Script {
    backend: DbBackend,
    statements: Vec<Statement>,
}

impl Script {
    /// An empty script for the backend of `db`, the connection it will run on.
    pub(crate) fn new(db: &impl ConnectionTrait) -> Self {
        Self {
            backend: db.get_database_backend(),
            statements: Vec::new(),
        }
    }

    /// Adds a statement of sea-orm's builders (an insert, update, delete or select).
    pub(crate) fn push(&mut self, query: &impl QueryTrait) {
        self.statements.push(query.build(self.backend));
    }

    /// Adds a statement built by sea-query itself (one with a `RETURNING` clause, say).
    pub(crate) fn push_query(&mut self, query: &impl StatementBuilder) {
        self.statements.push(self.backend.build(query));
    }

    /// Adds a statement written out, for the backend of the script, with anonymous `?`
    /// parameters (numbered ones would not line up with the other statements' on SQLite).
    pub(crate) fn push_statement(&mut self, statement: Statement) {
        self.statements.push(statement);
    }

    /// Runs every statement in order on `db` (in one hand-over on SQLite); returns the rows
    /// the statements changed, summed. Stops at the first statement that fails (the caller's
    /// transaction then rolls back the ones before it).
    pub(crate) async fn execute<C: ConnectionTrait>(self, db: &C) -> Result<u64> {
        let mut changed = 0;
        for statement in self.into_sent() {
            changed += db.execute_raw(statement).await?.rows_affected();
        }
        Ok(changed)
    }

    /// Runs every statement in order on `db` (in one hand-over on SQLite) and returns the
    /// rows they return, statement after statement (each row carries its own statement's
    /// columns).
    pub(crate) async fn query_all<C: ConnectionTrait>(self, db: &C) -> Result<Vec<QueryResult>> {
        let mut rows = Vec::new();
        for statement in self.into_sent() {
            rows.extend(db.query_all_raw(statement).await?);
        }
        Ok(rows)
    }

    /// What to send: on SQLite one text of every statement (parameters in order), elsewhere
    /// the statements one by one.
    fn into_sent(self) -> Vec<Statement> {
        if self.backend != DbBackend::Sqlite || self.statements.len() < 2 {
            return self.statements;
        }
        let mut sql = String::new();
        let mut values = Vec::new();
        for statement in self.statements {
            if !sql.is_empty() {
                sql.push_str(";\n");
            }
            sql.push_str(statement.sql.trim_end_matches(';'));
            values.extend(statement.values.into_iter().flat_map(|v| v.0));
        }
        vec![Statement::from_sql_and_values(self.backend, sql, values)]
    }
}
