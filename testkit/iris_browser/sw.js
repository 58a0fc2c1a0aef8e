// A service worker that handles pushes the way Iris's does (issue 33), written from that
// behaviour: nothing is shown while a window of this origin is visible; a push whose JSON has no
// `event` is dropped; kind 1060 (a double-ratchet message, decrypted by the app) is shown as a
// private message; other kinds show the push's title, body and icon; a click opens the push's
// url, forced onto this worker's own origin.

self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

async function windowVisible() {
  const windows = await self.clients.matchAll({ type: "window", includeUncontrolled: true });
  return windows.some((client) => client.visibilityState === "visible");
}

function ownOrigin(url) {
  try {
    const parsed = new URL(url, self.location.origin);
    return self.location.origin + parsed.pathname + parsed.search + parsed.hash;
  } catch (error) {
    return self.location.origin + "/";
  }
}

async function handlePush(data) {
  self.lastPush = data;
  if (await windowVisible()) {
    self.ignored = (self.ignored || 0) + 1;
    return;
  }
  if (!data || typeof data !== "object" || !data.event) {
    self.dropped = (self.dropped || 0) + 1;
    return;
  }
  const options = { data: { url: ownOrigin(data.url || "/") }, tag: String(data.event.id || "") };
  let title = "New private message";
  if (data.event.kind !== 1060) {
    title = data.title || "New notification";
    if (data.body) options.body = data.body;
    if (data.icon) options.icon = data.icon;
  }
  try {
    await self.registration.showNotification(title, options);
    self.shown = (self.shown || 0) + 1;
  } catch (error) {
    self.failed = String(error);
  }
}

self.addEventListener("push", (event) => {
  let data = null;
  try {
    data = event.data ? event.data.json() : null;
  } catch (error) {
    data = null;
  }
  event.waitUntil(handlePush(data));
});

self.addEventListener("notificationclick", (event) => {
  event.notification.close();
  const url = (event.notification.data && event.notification.data.url) || self.location.origin;
  event.waitUntil(self.clients.openWindow(ownOrigin(url)));
});
