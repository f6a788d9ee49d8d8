//! A small `getopt_long` work-alike: short option clusters (`-af`), attached or
//! separate option arguments (`-Ieth0`, `-I eth0`, `--interface=eth0`,
//! `--interface eth0`), positional arguments anywhere (argv permutation), and `--`.

/// One option the parser knows.
#[derive(Debug, Clone, Copy)]
pub struct Opt {
    /// Short letter.
    pub short: Option<char>,
    /// Long name.
    pub long: &'static str,
    /// Takes an argument.
    pub has_arg: bool,
}

/// A parsed command line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// Options in order, by long name, with their argument.
    pub opts: Vec<(&'static str, Option<String>)>,
    /// Positional arguments.
    pub positional: Vec<String>,
}

impl Parsed {
    /// True if the option was given.
    pub fn has(&self, long: &str) -> bool {
        self.opts.iter().any(|(n, _)| *n == long)
    }

    /// The last argument given to an option.
    pub fn value(&self, long: &str) -> Option<&str> {
        self.opts
            .iter()
            .rev()
            .find(|(n, _)| *n == long)
            .and_then(|(_, v)| v.as_deref())
    }
}

/// The start every smc-tools command shares: parses this process's arguments;
/// a parse error prints `PROG: error` and the usage to stderr, `--help` the usage,
/// `--version` the version line (`PROG utility, VERSION`); each of those ends the
/// program with the exit code returned in `Err`.
pub fn parse_args_or_exit(
    prog: &str,
    usage: &str,
    opts: &[Opt],
) -> Result<Parsed, std::process::ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let p = match parse(&args, opts) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{prog}: {e}");
            eprint!("{usage}");
            return Err(std::process::ExitCode::FAILURE);
        }
    };
    if p.has("help") {
        print!("{usage}");
        return Err(std::process::ExitCode::SUCCESS);
    }
    if p.has("version") {
        println!("{prog} utility, {}", crate::version());
        return Err(std::process::ExitCode::SUCCESS);
    }
    Ok(p)
}

/// Parses `args` (without the program name). Errors are getopt's messages
/// without the program name prefix.
pub fn parse(args: &[String], opts: &[Opt]) -> Result<Parsed, String> {
    let mut p = Parsed::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--" {
            p.positional.extend(it.by_ref().cloned());
            break;
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            // getopt_long accepts unambiguous prefixes of long names
            let matches: Vec<&Opt> = opts.iter().filter(|o| o.long.starts_with(name)).collect();
            let o = match matches.as_slice() {
                [o] => *o,
                _ => match opts.iter().find(|o| o.long == name) {
                    Some(o) => o,
                    None if matches.is_empty() => {
                        return Err(format!("unrecognized option '--{name}'"))
                    }
                    None => return Err(format!("option '--{name}' is ambiguous")),
                },
            };
            let v =
                if o.has_arg {
                    match inline {
                        Some(v) => Some(v),
                        None => Some(it.next().cloned().ok_or_else(|| {
                            format!("option '--{}' requires an argument", o.long)
                        })?),
                    }
                } else {
                    if inline.is_some() {
                        return Err(format!("option '--{}' doesn't allow an argument", o.long));
                    }
                    None
                };
            p.opts.push((o.long, v));
        } else if a.len() > 1 && a.starts_with('-') {
            let chars: Vec<char> = a.chars().skip(1).collect();
            let mut i = 0;
            while let Some(&c) = chars.get(i) {
                let o = opts
                    .iter()
                    .find(|o| o.short == Some(c))
                    .ok_or_else(|| format!("invalid option -- '{c}'"))?;
                if o.has_arg {
                    let rest: String = chars.iter().skip(i + 1).collect();
                    let v = if rest.is_empty() {
                        it.next()
                            .cloned()
                            .ok_or_else(|| format!("option requires an argument -- '{c}'"))?
                    } else {
                        rest
                    };
                    p.opts.push((o.long, Some(v)));
                    break;
                }
                p.opts.push((o.long, None));
                i += 1;
            }
        } else {
            p.positional.push(a.clone());
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPTS: &[Opt] = &[
        Opt {
            short: Some('a'),
            long: "add",
            has_arg: false,
        },
        Opt {
            short: Some('f'),
            long: "flush",
            has_arg: false,
        },
        Opt {
            short: Some('I'),
            long: "interface",
            has_arg: true,
        },
        Opt {
            short: None,
            long: "json",
            has_arg: false,
        },
    ];

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn permutation_clusters_and_arguments() {
        let p = parse(&s(&["-I", "eth1", "-a", "NET1"]), OPTS).unwrap();
        assert!(p.has("add"));
        assert_eq!(p.value("interface"), Some("eth1"));
        assert_eq!(p.positional, ["NET1"]);
        let p = parse(&s(&["NET1", "-aIeth2"]), OPTS).unwrap();
        assert_eq!(p.value("interface"), Some("eth2"));
        let p = parse(&s(&["--interface=eth3", "--ad", "X", "--json"]), OPTS).unwrap();
        assert_eq!(p.value("interface"), Some("eth3"));
        assert!(p.has("add") && p.has("json"));
        let p = parse(&s(&["--", "-a"]), OPTS).unwrap();
        assert_eq!(p.positional, ["-a"]);
    }

    #[test]
    fn errors() {
        assert_eq!(
            parse(&s(&["-x"]), OPTS).unwrap_err(),
            "invalid option -- 'x'"
        );
        assert_eq!(
            parse(&s(&["-I"]), OPTS).unwrap_err(),
            "option requires an argument -- 'I'"
        );
        assert!(parse(&s(&["--bogus"]), OPTS).is_err());
        assert!(parse(&s(&["--add=1"]), OPTS).is_err());
    }
}
