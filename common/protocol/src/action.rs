//! The Host API action vocabulary (PROTOCOL_V1 §8, host-behaviour §22.3 and Appendix A): the
//! one list of the actions a runner may call, by wire name.
//!
//! Every party that names an action reads it from here: the host's gate (metric labels), its
//! dispatcher (which action to serve) and the runner SDK (which name to send). The table below
//! is the only place a wire name is written, so the three cannot drift apart.
//!
//! Each action has one **canonical** name ([`Action::name`]), the name the SDK sends. The
//! storage actions also accept the seed host's name as an **alias**
//! ([`Action::seed_alias`]): `get_binary_storage`, `set_binary_storage`,
//! `delete_binary_storage` and `get_binary_storage_keys` are the same actions as
//! `storage_get`, `storage_set`, `storage_delete` and `storage_keys`. [`Action::parse`]
//! accepts both spellings; [`Action::WIRE_NAMES`] lists both, so a call under either is served
//! and labelled by the name it was sent under.

use std::fmt;

/// Declares [`Action`] and its name tables from one list of
/// `Variant => "canonical_name" | "seed_alias"` entries (the alias is optional).
macro_rules! actions {
    ($($variant:ident => $name:literal $(| $alias:literal)?),+ $(,)?) => {
        /// A Host API action (PROTOCOL_V1 §8). The wire carries it as a string; see the
        /// module docs for canonical names and aliases.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Action {
            $(
                #[doc = concat!("`", $name, "`", $(" (seed alias `", $alias, "`)")?)]
                $variant,
            )+
        }

        impl Action {
            /// Every action, in declaration order.
            pub const ALL: &'static [Action] = &[$(Self::$variant),+];

            /// Every wire name the host accepts: each canonical name, followed by its seed
            /// alias where it has one.
            pub const WIRE_NAMES: &'static [&'static str] = &[$($name, $($alias,)?)+];

            /// The canonical wire name (what the runner SDK sends).
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }

            /// The seed host's name of the action, accepted as an alias, if it has one.
            #[must_use]
            pub const fn seed_alias(self) -> Option<&'static str> {
                match self {
                    $(Self::$variant => actions!(@alias $($alias)?),)+
                }
            }

            /// The action for a wire name: its canonical name or its seed alias. `None` for
            /// a name outside the protocol.
            #[must_use]
            pub fn parse(name: &str) -> Option<Self> {
                Some(match name {
                    $($name $(| $alias)? => Self::$variant,)+
                    _ => return None,
                })
            }
        }
    };
    (@alias) => { None };
    (@alias $alias:literal) => { Some($alias) };
}

actions! {
    HistoryPage => "history_page",
    HistorySearch => "history_search",
    EventGet => "event_get",
    EventPage => "event_page",
    ArtifactMetadata => "artifact_metadata",
    ArtifactRead => "artifact_read",
    StateGet => "state_get",
    StateSet => "state_set",
    StateDelete => "state_delete",
    StateList => "state_list",
    StorageGet => "storage_get" | "get_binary_storage",
    StorageSet => "storage_set" | "set_binary_storage",
    StorageDelete => "storage_delete" | "delete_binary_storage",
    StorageKeys => "storage_keys" | "get_binary_storage_keys",
    SteeringPull => "steering_pull",
    GetHostVersion => "get_host_version",
    Ping => "ping",
    GetPrompt => "get_prompt",
    GetConfigFile => "get_config_file",
    InvokeLlm => "invoke_llm",
    InvokeLlmStream => "invoke_llm_stream",
    InvokeRerank => "invoke_rerank",
    GetToolDetail => "get_tool_detail",
    CallTool => "call_tool",
    RetrieveKnowledge => "retrieve_knowledge",
}

impl fmt::Display for Action {
    /// The canonical wire name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wire_name_parses_and_canonical_names_round_trip() {
        for &action in Action::ALL {
            assert_eq!(Action::parse(action.name()), Some(action));
            assert_eq!(action.to_string(), action.name());
            if let Some(alias) = action.seed_alias() {
                assert_eq!(Action::parse(alias), Some(action), "{alias}");
            }
        }
        for name in Action::WIRE_NAMES {
            assert!(Action::parse(name).is_some(), "{name}");
        }
        let aliases = Action::ALL.iter().filter_map(|a| a.seed_alias()).count();
        assert_eq!(Action::WIRE_NAMES.len(), Action::ALL.len() + aliases);
        assert_eq!(Action::parse("drop_tables"), None);
    }

    #[test]
    fn the_wire_names_are_the_protocol_s() {
        // The exact set of names on the wire (PROTOCOL_V1 §8, host-behaviour Appendix A):
        // changing one breaks deployed runners.
        let mut names = Action::WIRE_NAMES.to_vec();
        names.sort_unstable();
        let mut expected = vec![
            "invoke_llm",
            "invoke_llm_stream",
            "invoke_rerank",
            "get_tool_detail",
            "call_tool",
            "retrieve_knowledge",
            "get_prompt",
            "history_page",
            "history_search",
            "event_get",
            "event_page",
            "steering_pull",
            "artifact_metadata",
            "artifact_read",
            "state_get",
            "state_set",
            "state_delete",
            "state_list",
            "storage_get",
            "storage_set",
            "storage_delete",
            "storage_keys",
            "get_binary_storage",
            "set_binary_storage",
            "delete_binary_storage",
            "get_binary_storage_keys",
            "get_config_file",
            "get_host_version",
            "ping",
        ];
        expected.sort_unstable();
        assert_eq!(names, expected);
    }
}
