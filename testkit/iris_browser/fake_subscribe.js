// Headless Chromium has no push service: PushManager.subscribe() and getSubscription() answer
// with this subscription instead, whose keys the test owns (__SUBSCRIPTION__ is replaced by
// its JSON: endpoint and base64url p256dh and auth).
(() => {
  const sub = __SUBSCRIPTION__;
  const decode = (text) => {
    let s = text.replace(/-/g, "+").replace(/_/g, "/");
    while (s.length % 4) s += "=";
    const raw = atob(s);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes.buffer;
  };
  const fake = {
    endpoint: sub.endpoint, expirationTime: null, options: { userVisibleOnly: true },
    getKey: (name) => decode(sub.keys[name]), toJSON: () => sub, unsubscribe: async () => true,
  };
  if (self.PushManager) {
    PushManager.prototype.subscribe = async function () { return fake; };
    PushManager.prototype.getSubscription = async function () { return fake; };
  }
})();
