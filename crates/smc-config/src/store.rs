//! Where the configuration tables live, and how they are updated safely.
//!
//! Each table is a small line-oriented text file in the configuration directory:
//! `$SMC_RS_CONFIG_DIR` if set, else `/etc/smc-rs`. Readers see either the old or
//! the new file, never a torn one: updates take an exclusive lock on
//! `<dir>/.lock`, write a temporary file and rename it over the old one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Environment variable that overrides the configuration directory.
pub const ENV_CONFIG_DIR: &str = "SMC_RS_CONFIG_DIR";
/// Default configuration directory.
pub const DEFAULT_CONFIG_DIR: &str = "/etc/smc-rs";

/// A configuration directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigDir {
    path: PathBuf,
}

impl ConfigDir {
    /// `$SMC_RS_CONFIG_DIR`, or `/etc/smc-rs`.
    pub fn from_env() -> ConfigDir {
        match std::env::var_os(ENV_CONFIG_DIR) {
            Some(p) if !p.is_empty() => ConfigDir::at(p),
            _ => ConfigDir::at(DEFAULT_CONFIG_DIR),
        }
    }

    /// A specific directory.
    pub fn at(path: impl Into<PathBuf>) -> ConfigDir {
        ConfigDir { path: path.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Contents of table file `name`; an absent file or directory is an empty table.
    pub fn read(&self, name: &str) -> io::Result<String> {
        match fs::read_to_string(self.path.join(name)) {
            Ok(s) => Ok(s),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
            Err(e) => Err(e),
        }
    }

    /// Read-modify-write of table file `name` under an exclusive lock. `f` gets the
    /// current contents and returns the new contents, or an error that aborts the
    /// update without touching the file.
    pub fn update<E>(
        &self,
        name: &str,
        f: impl FnOnce(&str) -> Result<String, E>,
    ) -> Result<(), UpdateError<E>> {
        fs::create_dir_all(&self.path).map_err(UpdateError::Io)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.path.join(".lock"))
            .map_err(UpdateError::Io)?;
        lock.lock().map_err(UpdateError::Io)?;
        let old = self.read(name).map_err(UpdateError::Io)?;
        let new = f(&old).map_err(UpdateError::Rejected)?;
        if new != old {
            let tmp = self
                .path
                .join(format!(".{name}.tmp.{}", std::process::id()));
            let mut file = File::create(&tmp).map_err(UpdateError::Io)?;
            file.write_all(new.as_bytes()).map_err(UpdateError::Io)?;
            file.sync_all().map_err(UpdateError::Io)?;
            fs::rename(&tmp, self.path.join(name)).map_err(UpdateError::Io)?;
        }
        drop(lock); // releases the lock
        Ok(())
    }
}

/// A table kept in one file of the configuration directory.
pub trait Table: Sized {
    /// Why a table or a change to it is invalid.
    type Error: std::fmt::Display + std::fmt::Debug;
    /// Its file name in the directory.
    const FILE: &'static str;
    /// Parses the file's text.
    fn parse(text: &str) -> Result<Self, Self::Error>;
    /// The file's text.
    fn to_file(&self) -> String;

    /// Loads the table from a configuration directory (absent file: empty table).
    fn load(dir: &ConfigDir) -> Result<Self, LoadError<Self::Error>> {
        let text = dir
            .read(Self::FILE)
            .map_err(|e| LoadError::Io(Self::FILE, e))?;
        Self::parse(&text).map_err(LoadError::Table)
    }

    /// Applies `f` to the stored table under the directory's lock and saves it.
    fn modify(
        dir: &ConfigDir,
        f: impl FnOnce(&mut Self) -> Result<(), Self::Error>,
    ) -> Result<(), UpdateError<Self::Error>> {
        dir.update(Self::FILE, |old| {
            let mut t = Self::parse(old)?;
            f(&mut t)?;
            Ok(t.to_file())
        })
    }
}

/// Why a table could not be loaded.
#[derive(Debug)]
pub enum LoadError<E> {
    /// Reading the file failed.
    Io(&'static str, io::Error),
    /// The file is malformed.
    Table(E),
}

impl<E: std::fmt::Display> std::fmt::Display for LoadError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Io(file, e) => write!(f, "cannot read {file}: {e}"),
            LoadError::Table(e) => write!(f, "{e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for LoadError<E> {}

/// Why an update did not happen.
#[derive(Debug)]
pub enum UpdateError<E> {
    /// The file system refused (permissions, read-only, ...).
    Io(io::Error),
    /// The table refused the change (e.g. a duplicate entry).
    Rejected(E),
}

impl<E: std::fmt::Display> std::fmt::Display for UpdateError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpdateError::Io(e) => write!(f, "{e}"),
            UpdateError::Rejected(e) => write!(f, "{e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for UpdateError<E> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_missing_is_empty_and_update_is_atomic() {
        let dir = std::env::temp_dir().join(format!("smc-config-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let c = ConfigDir::at(&dir);
        assert_eq!(c.read("t").unwrap(), "");
        c.update::<String>("t", |old| Ok(format!("{old}a\n")))
            .unwrap();
        c.update::<String>("t", |old| Ok(format!("{old}b\n")))
            .unwrap();
        assert_eq!(c.read("t").unwrap(), "a\nb\n");
        let r = c.update::<String>("t", |_| Err("no".to_string()));
        assert!(matches!(r, Err(UpdateError::Rejected(ref e)) if e == "no"));
        assert_eq!(c.read("t").unwrap(), "a\nb\n");
        // no temporary files left behind
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| n == "t" || n == ".lock"), "{names:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn concurrent_updates_lose_nothing() {
        let dir = std::env::temp_dir().join(format!("smc-config-conc-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let c = ConfigDir::at(&dir);
                std::thread::spawn(move || {
                    for j in 0..20 {
                        c.update::<String>("t", |old| Ok(format!("{old}{i}-{j}\n")))
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let c = ConfigDir::at(&dir);
        assert_eq!(c.read("t").unwrap().lines().count(), 160);
        fs::remove_dir_all(&dir).unwrap();
    }
}
