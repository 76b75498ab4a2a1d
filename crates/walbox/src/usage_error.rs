//! Command-line errors that never quote what was typed. clap's own messages
//! repeat the offending argument or value (`unexpected argument
//! 'password=hunter2'`), and an unquoted connection string puts a password
//! exactly there. These messages name the problem, the position and the flag
//! (names from walbox's own definitions), never the text.

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// The message for `error` raised while parsing `argv` (with the program name
/// first) against `cmd`, or `None` when clap's own message quotes nothing typed
/// (help, version, a missing argument, a conflict) and may be printed as it is.
pub fn message(cmd: &clap::Command, error: &clap::Error, argv: &[String]) -> Option<String> {
    let args = argv.get(1..).unwrap_or_default();
    let command = command_path(cmd, args);
    let help = format!("see `{} --help`", command.join(" "));
    let flag = || match error.get(ContextKind::InvalidArg) {
        // For these kinds the context names the flag as walbox defines it.
        Some(ContextValue::String(flag)) => format!("the value given to {flag}"),
        _ => "a value".to_owned(),
    };
    let text = match error.kind() {
        ErrorKind::UnknownArgument => {
            // Here the context is what was typed: used only to find its position.
            let typed = match error.get(ContextKind::InvalidArg) {
                Some(ContextValue::String(s)) => Some(s.as_str()),
                _ => None,
            };
            let at = typed.and_then(|t| position(args, t));
            let place = match at {
                Some(i) => {
                    let after = known_flag_before(cmd, args, i)
                        .map(|f| format!(", after {f}"))
                        .unwrap_or_default();
                    format!(" (argument {}{after})", i + 1)
                }
                None => String::new(),
            };
            format!(
                "an unexpected argument{place}; a value with spaces, such as a connection \
                 string (--dsn 'host=db password=...'), must be quoted as one argument; {help}"
            )
        }
        ErrorKind::InvalidSubcommand => format!("an unknown command; {help}"),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
            let valid = match error.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(v)) if !v.is_empty() => {
                    format!(" (one of: {})", v.join(", "))
                }
                _ => String::new(),
            };
            format!("{} is not valid{valid}; {help}", flag())
        }
        ErrorKind::NoEquals => format!("{} must follow an \"=\"; {help}", flag()),
        ErrorKind::TooManyValues | ErrorKind::TooFewValues | ErrorKind::WrongNumberOfValues => {
            format!("{} has the wrong number of values; {help}", flag())
        }
        ErrorKind::InvalidUtf8 => format!("an argument is not valid UTF-8; {help}"),
        _ => return None,
    };
    Some(format!("error: {text}"))
}

/// The command and subcommand names `args` select, from `walbox`.
fn command_path(cmd: &clap::Command, args: &[String]) -> Vec<String> {
    let mut path = vec![cmd.get_name().to_owned()];
    let mut current = cmd;
    for arg in args {
        match current.find_subcommand(arg) {
            Some(sub) => {
                path.push(sub.get_name().to_owned());
                current = sub;
            }
            None if arg.starts_with('-') => continue,
            None => break,
        }
    }
    path
}

/// Where `typed` is in `args`: the argument itself, or a `--flag=value` it
/// is the flag of.
fn position(args: &[String], typed: &str) -> Option<usize> {
    args.iter()
        .position(|a| a == typed)
        .or_else(|| args.iter().position(|a| a.split('=').next() == Some(typed)))
}

/// The nearest flag before `args[at]` that walbox defines, in walbox's
/// spelling: a flag typed wrong is not repeated.
fn known_flag_before(cmd: &clap::Command, args: &[String], at: usize) -> Option<String> {
    let mut known = Vec::new();
    collect_flags(cmd, &mut known);
    args[..at].iter().rev().find_map(|a| {
        let name = a.split('=').next().unwrap_or_default();
        known.iter().find(|k| *k == name).cloned()
    })
}

fn collect_flags(cmd: &clap::Command, out: &mut Vec<String>) {
    for arg in cmd.get_arguments() {
        if let Some(long) = arg.get_long() {
            out.push(format!("--{long}"));
        }
        if let Some(short) = arg.get_short() {
            out.push(format!("-{short}"));
        }
    }
    for sub in cmd.get_subcommands() {
        collect_flags(sub, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(argv: &[&str]) -> Option<String> {
        let cmd = crate::command_line();
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let err = cmd.clone().try_get_matches_from(&argv).unwrap_err();
        message(&cmd, &err, &argv)
    }

    #[test]
    fn an_unexpected_argument_is_named_by_position_and_the_flag_before_it() {
        let m = render(&["walbox", "doctor", "--dsn", "host=x", "password=hunter2"]).unwrap();
        assert!(!m.contains("hunter2"), "{m}");
        assert!(
            m.contains("argument 4, after --dsn")
                && m.contains("quoted as one argument")
                && m.contains("walbox doctor --help"),
            "{m}"
        );
        // A mistyped flag is not repeated either, nor taken for a known one.
        let m = render(&["walbox", "run", "--dsn=a", "--hunter2=x"]).unwrap();
        assert!(!m.contains("hunter2") && m.contains("argument 3"), "{m}");
    }

    #[test]
    fn a_bad_value_names_the_flag_not_the_value() {
        let m = render(&["walbox", "verify", "--timeout-s", "hunter2"]).unwrap();
        assert!(!m.contains("hunter2") && m.contains("--timeout-s"), "{m}");
        let m = render(&["walbox", "hunter2"]).unwrap();
        assert!(
            !m.contains("hunter2") && m.contains("unknown command"),
            "{m}"
        );
    }

    #[test]
    fn help_and_errors_that_quote_nothing_are_left_to_clap() {
        assert!(render(&["walbox", "--help"]).is_none());
        assert!(render(&["walbox"]).is_none());
    }
}
